"""deploy/geodns against a real PowerDNS (pdns_server 4.7, bind + geoip backends) and a real gateway process.

The zone is deploy/geodns's own file with its documented placeholders replaced: the carriers sit on
127.0.0.2/.3/.4 (one port), the health URLs point at the gateway's HTTP port, and the GeoIP database is
written by the test (1.0.0.0/24 in Asia, 2.0.0.0/24 in Europe, 3.0.0.0/24 in North America). Clients in
those continents are simulated with the EDNS client subnet option; nothing leaves loopback.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import dns.edns
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from edge_agent.discovery import GatewayDiscovery
from gateway.testing import wait_for
from gateway.testing_servers import free_port
from tests.gateway.daemon.process import GatewayProcess, write_config
from tests.routing.test_geo import country_record, write_db

GEODNS = Path(__file__).parents[2] / "deploy" / "geodns"
ZONE = "ingest.hk.example.com."
SRV_NAME = f"_edgeinfer._tcp.{ZONE}"
CARRIERS = {"hgc": "127.0.0.2", "pccw": "127.0.0.3", "tgt": "127.0.0.4"}
# Where each continent's preferred carrier comes from: the zone's `prefer` table.
CLIENTS = {"asia": ("1.0.0.0", "hgc"), "europe": ("2.0.0.0", "tgt"), "north-america": ("3.0.0.0", "pccw")}
CHECK_INTERVAL_S = 1  # lua-health-checks-interval in the test (production: 2, deploy/geodns/pdns.conf)
WITHIN_S = 5.0  # "a few seconds": check interval + the gateway's fall/rise + one query


def install_geodns(into: Path, health_base: str, port: int) -> Path:
    """deploy/geodns copied to ``into`` with its placeholders replaced (each must be there to replace)."""
    shutil.copytree(GEODNS, into, dirs_exist_ok=True)
    zone = into / "zones" / "ingest.hk.example.com.zone"
    text = zone.read_text()
    for placeholder, value in {
        "203.0.113.10": CARRIERS["hgc"],
        "198.51.100.10": CARRIERS["pccw"],
        "192.0.2.10": CARRIERS["tgt"],
        "http://10.20.0.5:9102": health_base,
        "port=5555": f"port={port}",
    }.items():
        assert placeholder in text, f"the zone no longer has the documented placeholder {placeholder}"
        text = text.replace(placeholder, value)
    zone.write_text(text)
    named = into / "named.conf"
    named.write_text(named.read_text().replace("/etc/powerdns/geodns", str(into)))
    write_db(
        into / "geo.mmdb",
        "GeoLite2-Country",
        {
            "1.0.0.0/24": country_record("AS", "JP"),
            "2.0.0.0/24": country_record("EU", "DE"),
            "3.0.0.0/24": country_record("NA", "US"),
        },
    )
    return into


def server_args(root: Path) -> list[str]:
    """deploy/geodns/pdns.conf as shipped, with only paths, the listen address and the interval overridden."""
    return [
        f"--config-dir={root}",
        f"--bind-config={root}/named.conf",
        f"--geoip-zones-file={root}/geo-zones.yaml",
        f"--geoip-database-files=mmdb:{root}/geo.mmdb",
        f"--lua-health-checks-interval={CHECK_INTERVAL_S}",
        f"--socket-dir={root}",
        "--setuid=",
        "--setgid=",
    ]


class PowerDNS:
    """``pdns_server`` in the foreground on 127.0.0.1 at a free port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.log = root / "pdns.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        tool = shutil.which("pdns_server")
        assert tool, "pdns_server missing: the test command installs the Debian package pdns-server"
        with self.log.open("wb") as log:
            self._proc = subprocess.Popen(
                [
                    tool,
                    *server_args(self.root),
                    *("--daemon=no", "--guardian=no", "--write-pid=no"),
                    *("--local-address=127.0.0.1", f"--local-port={self.port}"),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            assert self._proc.poll() is None, f"pdns_server exited: {self.log.read_text()[-2000:]}"
            with contextlib.suppress(dns.exception.DNSException, OSError):
                if self.query(ZONE, "SOA")[0] == dns.rcode.NOERROR:
                    return
            assert time.monotonic() < deadline, f"pdns_server not answering: {self.log.read_text()[-2000:]}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)

    def query(self, name: str, rdtype: str, client: str | None = None) -> tuple[int, list[str]]:
        """rcode and answer texts; ``client`` is sent as an EDNS client subnet (/24)."""
        options = [dns.edns.ECSOption(client, 24)] if client else []
        query = dns.message.make_query(name, rdtype, use_edns=0, options=options)
        reply = dns.query.udp(query, "127.0.0.1", port=self.port, timeout=2)
        return reply.rcode(), [item.to_text() for rrset in reply.answer for item in rrset]

    def addresses(self, client: str | None = None) -> list[str]:
        rcode, answer = self.query(ZONE, "A", client)
        assert rcode == dns.rcode.NOERROR, dns.rcode.to_text(rcode)
        return answer

    def srv(self, client: str | None = None) -> list[tuple[int, str]]:
        """(priority, carrier) pairs sorted by priority."""
        rcode, answer = self.query(SRV_NAME, "SRV", client)
        assert rcode == dns.rcode.NOERROR, dns.rcode.to_text(rcode)
        fields = [text.split() for text in answer]
        return sorted((int(f[0]), f[3].split(".")[0]) for f in fields)


@pytest.fixture
def geodns_port() -> int:
    return free_port(CARRIERS["hgc"])


@pytest.fixture
async def gateway(tmp_path: Path, models_dir: Path, geodns_port: int) -> AsyncIterator[GatewayProcess]:
    binds = {name: f"tcp://{address}:{geodns_port}" for name, address in CARRIERS.items()}
    config = write_config(tmp_path / "gateway.toml", models_dir, binds=binds)
    process = GatewayProcess(config)
    await process.start()
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
def pdns(tmp_path: Path, gateway: GatewayProcess, geodns_port: int) -> Iterator[PowerDNS]:
    root = install_geodns(tmp_path / "geodns", f"http://127.0.0.1:{gateway.http_port}", geodns_port)
    server = PowerDNS(root)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def settled(pdns: PowerDNS) -> None:
    """The first queries start the health checks (until they report, every carrier counts as down)."""
    europe = CLIENTS["europe"][0]
    await wait_for(lambda: pdns.addresses(europe) == [CARRIERS["tgt"]], 10, what="first health checks")
    # Each carrier's check reports on its own: wait until every one has (every SRV answer lists all three).
    await wait_for(
        lambda: all({c for _, c in pdns.srv(subnet)} == set(CARRIERS) for subnet, _ in CLIENTS.values()),
        10,
        what="every carrier's first health check",
    )


async def admin(gateway: GatewayProcess, carrier: str, action: str) -> None:
    url = f"http://127.0.0.1:{gateway.http_port}/admin/carriers/{carrier}/{action}"
    async with aiohttp.ClientSession() as session, session.post(url) as resp:
        assert resp.status == 200, await resp.text()


def test_zone_passes_pdnsutil_check_zone(tmp_path: Path) -> None:
    """The shipped zone loads into the bind backend with no error and no warning."""
    root = install_geodns(tmp_path, "http://127.0.0.1:9102", 5555)
    overrides = [arg.removeprefix("--") for arg in server_args(root)[1:]]  # later lines win
    (root / "pdns-check.conf").write_text("\n".join([(root / "pdns.conf").read_text(), *overrides, ""]))
    done = subprocess.run(
        ["pdnsutil", f"--config-dir={root}", "--config-name=check", "check-zone", ZONE.rstrip(".")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 errors, 0 warnings" in done.stdout, done.stdout + done.stderr


async def test_each_continent_gets_its_preferred_carrier_first(pdns: PowerDNS) -> None:
    """A: one address, the continent's preferred healthy carrier; SRV: all three, that one at priority 10."""
    await settled(pdns)
    first = {}
    for client, (subnet, carrier) in CLIENTS.items():
        assert pdns.addresses(subnet) == [CARRIERS[carrier]], client
        srv = pdns.srv(subnet)
        assert [p for p, _ in srv] == [10, 20, 30] and srv[0][1] == carrier, (client, srv)
        assert {c for _, c in srv} == set(CARRIERS), srv
        first[client] = srv[0][1]
    assert len(set(first.values())) == len(CLIENTS), first
    # No client subnet and an address outside the database: the default (Asian) order.
    assert pdns.addresses() == [CARRIERS["hgc"]]


async def test_drained_carrier_leaves_the_answer_within_seconds_and_returns(
    pdns: PowerDNS, gateway: GatewayProcess
) -> None:
    """Draining TGT (health 503 STATUS:DRAINING) drops it from A and SRV; enabling it brings it back."""
    await settled(pdns)
    europe = CLIENTS["europe"][0]
    await admin(gateway, "tgt", "disable")
    dropped = await wait_for(
        lambda: pdns.addresses(europe) == [CARRIERS["pccw"]] and "tgt" not in dict(map(reversed, pdns.srv())),
        WITHIN_S,
        what="TGT dropped after its drain",
    )
    assert pdns.srv(europe) == [(10, "pccw"), (20, "hgc")]
    await admin(gateway, "tgt", "enable")
    returned = await wait_for(
        lambda: pdns.addresses(europe) == [CARRIERS["tgt"]], WITHIN_S, what="TGT back after enable"
    )
    assert pdns.srv(europe) == [(10, "tgt"), (20, "pccw"), (30, "hgc")]
    print(f"dropped after {dropped:.1f} s, back after {returned:.1f} s")


async def test_agent_discovery_follows_the_healthy_carriers(pdns: PowerDNS, gateway: GatewayProcess) -> None:
    """The edge agent's SRV discovery, pointed at this server, gets the live carrier list in order."""
    await settled(pdns)
    now = [0.0]  # the agent's clock: advanced past the record's TTL (20 s) below instead of waiting
    discovery = GatewayDiscovery(
        SRV_NAME, mode="srv", nameservers=[("127.0.0.1", pdns.port)], clock=lambda: now[0]
    )
    found = await discovery.resolve()
    assert found.source == "srv" and found.reason is None, found
    assert [(e.name, e.endpoint) for e in found.endpoints] == [
        (name, gateway.endpoint(name)) for name in ("hgc", "pccw", "tgt")
    ]
    await admin(gateway, "hgc", "disable")
    await wait_for(lambda: pdns.addresses() == [CARRIERS["pccw"]], WITHIN_S, what="HGC dropped")
    assert [e.name for e in (await discovery.resolve()).endpoints] == ["hgc", "pccw", "tgt"]  # cached
    now[0] += found.ttl_s + 0.1
    found = await discovery.resolve()
    assert [e.name for e in found.endpoints] == ["pccw", "tgt"], found


async def test_gateway_stopped_answers_every_carrier_as_the_fallback(
    pdns: PowerDNS, gateway: GatewayProcess
) -> None:
    """SIGTERM: the gateway drains (every carrier 503) and exits (health unreachable). With no healthy
    carrier the stated fallback applies: all three addresses, SRV in the client's preference order."""
    await settled(pdns)
    gateway.signal(signal.SIGTERM)
    await wait_for(lambda: len(pdns.addresses()) == 3, WITHIN_S, what="fallback to every carrier")
    assert sorted(pdns.addresses(CLIENTS["europe"][0])) == sorted(CARRIERS.values())
    assert pdns.srv(CLIENTS["europe"][0]) == [(10, "tgt"), (20, "pccw"), (30, "hgc")]
    assert await gateway.wait(30) == 0
    assert len(pdns.addresses()) == 3  # and so it stays while the gateway is gone
