"""Route health injection against real peers: a gateway, ExaBGP 5 running deploy/bgp/exabgp.conf with the
gateway's announcers, and BIRD 2 as the three carriers' routers.

BIRD runs in a network namespace this test creates; veth pairs join it to the test's own namespace, which
the test command (scripts/test.sh) made with ``unshare --net`` and which holds nothing but loopback: the
test refuses to run anywhere else. The link addresses are deploy/bgp's placeholders (198.18.0.0/29,
RFC 2544's benchmarking range), so exabgp.conf runs as shipped but for the announcer's paths.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.server import Gateway
from gateway.testing import run_gateway, wait_for
from gateway.testing_servers import free_port
from service.configfile import merge_tables
from tests.gateway.daemon.process import GatewayProcess, write_config
from tests.gateway.daemon.test_dispatch import backend, split_backends

DEPLOY = Path(__file__).parents[2] / "deploy" / "bgp"
LOCAL_AS = 64496
# carrier -> (our link address, the carrier router's, its AS, the prefix announced to it)
PEERS = {
    "hgc": ("198.18.0.0", "198.18.0.1", 64497, "203.0.113.0/24"),
    "pccw": ("198.18.0.2", "198.18.0.3", 64498, "198.51.100.0/24"),
    "tgt": ("198.18.0.4", "198.18.0.5", 64499, "192.0.2.0/24"),
}
INTERVAL_S, TIMEOUT_S, RISE, FALL = 0.2, 0.2, 2, 2
WITHDRAW_WITHIN_S = FALL * INTERVAL_S + TIMEOUT_S + 1.0  # the stated bound plus BGP propagation slack


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def _isolated() -> bool:
    """True when this network namespace has no interface but loopback (the test command's unshare)."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]


@pytest.fixture(scope="module")
def carriers_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A namespace for BIRD, one veth pair per carrier link, BIRD running in it; yields birdc's socket."""
    for tool in ("ip", "bird", "birdc"):
        assert shutil.which(tool), f"{tool} missing: the test command installs iproute2 and bird2"
    if os.geteuid() != 0 or not _isolated():
        pytest.skip("needs root in a namespace with only loopback: run it through scripts/test.sh")
    root = tmp_path_factory.mktemp("bird")
    netns = f"hkbgp-{os.getpid()}"
    _run("ip", "netns", "add", netns)
    bird: subprocess.Popen[bytes] | None = None
    try:
        _run("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")
        protocols = []
        for i, (name, (ours, theirs, asn, _)) in enumerate(PEERS.items()):
            _run(
                "ip",
                "link",
                "add",
                f"hkbgp{i}a",
                "type",
                "veth",
                "peer",
                "name",
                f"hkbgp{i}b",
                "netns",
                netns,
            )
            _run("ip", "addr", "add", f"{ours}/31", "dev", f"hkbgp{i}a")
            _run("ip", "link", "set", f"hkbgp{i}a", "up")
            _run("ip", "netns", "exec", netns, "ip", "addr", "add", f"{theirs}/31", "dev", f"hkbgp{i}b")
            _run("ip", "netns", "exec", netns, "ip", "link", "set", f"hkbgp{i}b", "up")
            protocols.append(
                f"protocol bgp {name} {{\n  local {theirs} as {asn};\n  neighbor {ours} as {LOCAL_AS};\n"
                "  ipv4 { import all; export none; };\n}\n"
            )
        conf = root / "bird.conf"
        conf.write_text("router id 198.18.0.1;\nprotocol device {}\n" + "".join(protocols))
        socket = str(root / "bird.ctl")
        with (root / "bird.log").open("wb") as log:
            bird = subprocess.Popen(
                ["ip", "netns", "exec", netns, "bird", "-f", "-c", str(conf), "-s", socket],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while not Path(socket).exists():
            assert bird.poll() is None and time.monotonic() < deadline, (root / "bird.log").read_text()
            time.sleep(0.05)
        yield socket
    finally:
        if bird is not None:
            bird.terminate()
            bird.wait(10)
        subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True, timeout=30)
        for i in range(len(PEERS)):
            subprocess.run(["ip", "link", "del", f"hkbgp{i}a"], check=False, capture_output=True, timeout=30)


def routes(socket: str) -> dict[str, dict[str, Any]]:
    """BIRD's table: prefix -> {"protocol", "as_path", "communities"}."""
    out = subprocess.run(
        ["birdc", "-s", socket, "show", "route", "all"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    table: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in out.splitlines():
        head = re.match(r"^(\d+\.\d+\.\d+\.\d+/\d+)\s+unicast \[(\w+)", line)
        if head:
            current = table[head.group(1)] = {"protocol": head.group(2), "as_path": [], "communities": []}
        elif current is not None and "BGP.as_path:" in line:
            current["as_path"] = [int(a) for a in line.split(":", 1)[1].split()]
        elif current is not None and "BGP.community:" in line:
            current["communities"] = re.findall(r"\((\d+),(\d+)\)", line)
    return table


def announcer_config(path: Path, http_port: int, extra: str = "") -> Path:
    """The gateway TOML the announcers read: carriers with their [carriers.bgp], the HTTP port."""
    blocks = []
    for name, (_, theirs, asn, prefix) in PEERS.items():
        blocks.append(
            f'[[carriers]]\nname = "{name}"\nbind = "tcp://127.0.0.1:*"\n[carriers.bgp]\n'
            f'neighbor = "{theirs}"\nlocal_as = {LOCAL_AS}\nprefixes = ["{prefix}"]\n'
            f'communities = ["{asn}:100"]\ndegraded_prepend = 3\ndegraded_communities = ["{asn}:80"]\n'
            f"interval_s = {INTERVAL_S}\ntimeout_s = {TIMEOUT_S}\nrise = {RISE}\nfall = {FALL}\n"
        )
    path.write_text(
        f'{"".join(blocks)}[security]\nmode = "plaintext"\n[http]\nport = {http_port}\n'
        f'[logging]\nformat = "json"\n{extra}'
    )
    return path


class ExaBgp:
    """deploy/bgp/exabgp.conf as shipped, the announcers pointed at this checkout and ``gateway_toml``."""

    def __init__(self, root: Path, gateway_toml: Path) -> None:
        text = (DEPLOY / "exabgp.conf").read_text()
        for placeholder, value in {
            "/opt/hk-edge-gateway/.venv/bin/hk-gateway": str(Path(sys.prefix) / "bin" / "hk-gateway"),
            "/etc/hk-gateway/hk-gateway.toml": str(gateway_toml),
        }.items():
            assert placeholder in text
            text = text.replace(placeholder, value)
        self.conf = root / "exabgp.conf"
        self.conf.write_text(text)
        self.log = root / "exabgp.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "exabgp_daemon_user": "root", "exabgp_log_destination": "stdout"}
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(Path(sys.prefix) / "bin" / "exabgp"), str(self.conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture
def exabgp_factory(tmp_path: Path) -> Iterator[Callable[[Path], ExaBgp]]:
    started: list[ExaBgp] = []

    def make(gateway_toml: Path) -> ExaBgp:
        speaker = ExaBgp(tmp_path, gateway_toml)
        speaker.start()
        started.append(speaker)
        return speaker

    yield make
    for speaker in started:
        speaker.stop()


@pytest.fixture
async def gateway(models_dir: Path, tmp_path: Path) -> AsyncIterator[tuple[Gateway, Path]]:
    """A real gateway (pools on fault-injecting backends) and the TOML its announcers read."""
    port = free_port()
    toml = announcer_config(tmp_path / "gateway.toml", port)
    overrides = merge_tables(
        split_backends(models_dir),
        {"health": {"interval_s": 0.1, "rise": 2, "fall": 2}, "drain_timeout_s": 5.0, "drain_grace_s": 0.0},
    )
    config = load_config(toml, environ={}, overrides=overrides)
    async with run_gateway(config) as gw:
        yield gw, toml


async def admin(port: int, carrier: str, action: str) -> None:
    url = f"http://127.0.0.1:{port}/admin/carriers/{carrier}/{action}"
    async with aiohttp.ClientSession() as session, session.post(url) as resp:
        assert resp.status == 200


async def test_routes_follow_carrier_health(
    carriers_net: str, gateway: tuple[Gateway, Path], exabgp_factory: Callable[[Path], ExaBgp]
) -> None:
    """UP: each carrier has its own prefix, plain path, its community. DEGRADED: AS path prepended 3 times
    and the de-preferring community. Drain of one carrier, and its ingress failing, withdraw only its prefix
    within the stated time; healthy again, it returns."""
    gw, toml = gateway
    assert gw.http is not None
    port = gw.http.port
    exabgp_factory(toml)
    hgc, pccw, tgt = (PEERS[c][3] for c in ("hgc", "pccw", "tgt"))
    await wait_for(
        lambda: set(routes(carriers_net)) == {hgc, pccw, tgt}, 15, what="sessions up, all announced"
    )
    table = routes(carriers_net)
    for name, (_, _, asn, prefix) in PEERS.items():
        assert table[prefix]["protocol"] == name  # each prefix only over its own carrier
        assert table[prefix]["as_path"] == [LOCAL_AS]
        assert table[prefix]["communities"] == [(str(asn), "100")]

    backend(gw, "gpu").healthy = False  # a tier without a healthy pool: every carrier DEGRADED
    await wait_for(
        lambda: routes(carriers_net)[hgc]["as_path"] == [LOCAL_AS] * 4, 5, what="prepended while DEGRADED"
    )
    assert sorted(routes(carriers_net)[hgc]["communities"]) == [("64497", "100"), ("64497", "80")]
    backend(gw, "gpu").healthy = True
    await wait_for(lambda: routes(carriers_net)[hgc]["as_path"] == [LOCAL_AS], 5, what="plain again when UP")

    await admin(port, "pccw", "disable")
    took = await wait_for(
        lambda: pccw not in routes(carriers_net), WITHDRAW_WITHIN_S, what="PCCW withdrawn on drain"
    )
    assert set(routes(carriers_net)) == {hgc, tgt}
    await admin(port, "pccw", "enable")
    await wait_for(lambda: pccw in routes(carriers_net), 5, what="PCCW announced again")

    await gw.carriers["tgt"].close()  # the TGT ingress fails: health DOWN
    failed = await wait_for(
        lambda: tgt not in routes(carriers_net), WITHDRAW_WITHIN_S + 1, what="TGT withdrawn"
    )
    assert set(routes(carriers_net)) == {hgc, pccw}
    print(f"drain withdrawn after {took:.2f} s, failed ingress after {failed:.2f} s")


async def test_drained_or_killed_gateway_withdraws_every_carrier_and_returns(
    carriers_net: str, models_dir: Path, tmp_path: Path, exabgp_factory: Callable[[Path], ExaBgp]
) -> None:
    """SIGTERM (systemctl stop): health DRAINING at once, every prefix withdrawn at the next reading, while
    the gateway is still draining. kill -9: health stops answering, every prefix withdrawn within the
    stated fall time. Each time a new gateway on the same port brings the prefixes back."""
    port = free_port()
    toml = announcer_config(tmp_path / "announcers.toml", port)
    prefixes = {p[3] for p in PEERS.values()}
    took: dict[str, float] = {}
    exabgp_started = False
    for step in ("drain", "kill", "final"):
        (tmp_path / step).mkdir()
        gateway = GatewayProcess(write_config(tmp_path / step / "gateway.toml", models_dir, http_port=port))
        await gateway.start()
        if not exabgp_started:
            exabgp_factory(toml)
            exabgp_started = True
        try:
            await wait_for(lambda: set(routes(carriers_net)) == prefixes, 15, what=f"all announced ({step})")
            if step == "drain":
                gateway.signal(signal.SIGTERM)
                took[step] = await wait_for(
                    lambda: not routes(carriers_net), INTERVAL_S + TIMEOUT_S + 1.0, what="withdrawn on drain"
                )
                assert gateway.proc is not None and gateway.proc.returncode is None  # still draining
                assert await gateway.wait(30) == 0
            elif step == "kill":
                gateway.kill_group()
                took[step] = await wait_for(
                    lambda: not routes(carriers_net), WITHDRAW_WITHIN_S, what="all withdrawn after kill -9"
                )
        finally:
            await gateway.stop()
    print(f"withdrawn {took['drain']:.2f} s after SIGTERM, {took['kill']:.2f} s after kill -9")
