"""Gateway discovery against a real authoritative DNS server on loopback: SRV, A/AAAA, TTLs, fallbacks."""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import dns.asyncquery
import dns.message
import dns.rcode
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge_agent.discovery import (
    CarrierEndpoint,
    Discovered,
    FailureReason,
    GatewayDiscovery,
    SrvRecord,
    clamp_ttl,
    endpoint_url,
    order_srv,
    parse_nameserver,
    srv_endpoints,
)
from edge_agent.testing_dns import AuthoritativeDNS

SRV_NAME = "_edgeinfer._tcp.ingest.hk.example."
HOST_NAME = "ingest.hk.example."
STATIC = [CarrierEndpoint("static-hgc", "tcp://127.0.0.1:5555")]
BOUND_S = 5.0  # every wait in these tests ends by then


class FakeClock:
    """Monotonic seconds that only move when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def eventually(predicate: Callable[[], bool], within_s: float = BOUND_S) -> None:
    """Poll ``predicate`` until it holds, failing the test after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {within_s} s")
        await asyncio.sleep(0.01)


def three_carriers(server: AuthoritativeDNS, ttl: int = 60) -> None:
    """hgc (priority 10), pccw (10, lower weight), tgt (20) with IPv4 loopback addresses."""
    server.set_srv(
        SRV_NAME,
        [
            (20, 100, 5557, "tgt.ingest.hk.example."),
            (10, 10, 5556, "pccw.ingest.hk.example."),
            (10, 50, 5555, "hgc.ingest.hk.example."),
        ],
        ttl,
    )
    server.set_a("hgc.ingest.hk.example.", ["127.0.0.11"], ttl)
    server.set_a("pccw.ingest.hk.example.", ["127.0.0.12"], ttl)
    server.set_a("tgt.ingest.hk.example.", ["127.0.0.13"], ttl)


THREE = (
    CarrierEndpoint("hgc", "tcp://127.0.0.11:5555"),
    CarrierEndpoint("pccw", "tcp://127.0.0.12:5556"),
    CarrierEndpoint("tgt", "tcp://127.0.0.13:5557"),
)


@pytest.fixture
async def server() -> AsyncIterator[AuthoritativeDNS]:
    """A started test DNS server on 127.0.0.1 with an empty zone."""
    async with AuthoritativeDNS() as dns_server:
        yield dns_server


def srv_discovery(server: AuthoritativeDNS, **kwargs: Any) -> GatewayDiscovery:
    """SRV discovery of ``SRV_NAME`` through ``server``, static fallback ``STATIC``, 0.5 s timeout."""
    return GatewayDiscovery(
        SRV_NAME,
        mode="srv",
        nameservers=[server.address],
        static=STATIC,
        timeout_s=0.5,
        **kwargs,
    )


async def test_srv_returns_carriers_in_priority_order_with_ports_and_addresses(
    server: AuthoritativeDNS,
) -> None:
    """SRV discovery yields one endpoint per target, by priority then weight, on the target's address."""
    three_carriers(server)
    found = await srv_discovery(server).resolve()
    assert found.endpoints == THREE
    assert found.source == "srv"
    assert found.error == ""
    assert found.reason is None


async def test_srv_uses_additional_section_without_asking_for_targets(server: AuthoritativeDNS) -> None:
    """Target addresses sent in the additional section are used; no A/AAAA query follows."""
    three_carriers(server)
    await srv_discovery(server).resolve()
    assert server.query_count("hgc.ingest.hk.example.", "A") == 0
    assert server.total_queries == 1


async def test_srv_targets_are_queried_when_additional_section_is_empty() -> None:
    """Without additional records the targets' A and AAAA are asked for and give the same endpoints."""
    async with AuthoritativeDNS(include_additional=False) as bare:
        three_carriers(bare)
        found = await srv_discovery(bare).resolve()
        assert found.endpoints == THREE
        assert bare.query_count("hgc.ingest.hk.example.", "A") == 1
        assert bare.query_count("tgt.ingest.hk.example.", "AAAA") == 1


async def test_srv_target_with_only_aaaa_gets_bracketed_ipv6_endpoint(server: AuthoritativeDNS) -> None:
    """A target with only an AAAA record is reached over IPv6, bracketed in the endpoint."""
    server.set_srv(SRV_NAME, [(10, 0, 5555, "hgc.ingest.hk.example.")], 60)
    server.set_aaaa("hgc.ingest.hk.example.", ["::1"], 60)
    found = await srv_discovery(server).resolve()
    assert found.endpoints == (CarrierEndpoint("hgc", "tcp://[::1]:5555"),)


async def test_srv_target_that_does_not_exist_is_skipped(server: AuthoritativeDNS) -> None:
    """An SRV target with no address records (NXDOMAIN) is left out; the other carriers remain."""
    three_carriers(server)
    server.remove("pccw.ingest.hk.example.")
    found = await srv_discovery(server).resolve()
    assert [e.name for e in found.endpoints] == ["hgc", "tgt"]
    assert found.source == "srv"


async def test_large_srv_answer_arrives_over_tcp_after_truncation(server: AuthoritativeDNS) -> None:
    """An SRV set too big for a UDP answer is truncated and fetched whole over TCP."""
    records = [(10, 0, 6000 + i, f"c{i:02d}.ingest.hk.example.") for i in range(40)]
    server.set_srv(SRV_NAME, records, 60)
    for i in range(40):
        server.set_a(f"c{i:02d}.ingest.hk.example.", [f"127.0.1.{i + 1}"], 60)
    found = await srv_discovery(server).resolve()
    assert server.truncated >= 1
    assert len(found.endpoints) == 40
    assert found.endpoints[0] == CarrierEndpoint("c00", "tcp://127.0.1.1:6000")


async def test_address_mode_returns_a_records_with_configured_port(server: AuthoritativeDNS) -> None:
    """Address mode yields every A address (answer order), then AAAA, each on the configured port."""
    server.set_a(HOST_NAME, ["127.0.0.21", "127.0.0.22"], 60)
    server.set_aaaa(HOST_NAME, ["::1"], 60)
    discovery = GatewayDiscovery(HOST_NAME, mode="address", port=5555, nameservers=[server.address])
    found = await discovery.resolve()
    assert {e.endpoint for e in found.endpoints[:2]} == {"tcp://127.0.0.21:5555", "tcp://127.0.0.22:5555"}
    assert found.endpoints[2] == CarrierEndpoint("::1", "tcp://[::1]:5555")
    assert found.endpoints[0].name == found.endpoints[0].endpoint.removeprefix("tcp://").split(":")[0]
    assert found.source == "address"


async def test_ttl_is_smallest_ttl_of_the_rrsets_used(server: AuthoritativeDNS) -> None:
    """The answer's TTL is the smallest of the SRV and target address TTLs."""
    three_carriers(server, ttl=120)
    server.set_a("pccw.ingest.hk.example.", ["127.0.0.12"], 45)
    found = await srv_discovery(server).resolve()
    assert found.ttl_s == 45.0


async def test_ttl_is_clamped_to_configured_bounds(server: AuthoritativeDNS) -> None:
    """A TTL above max_ttl_s is cut to it; a TTL of zero is raised to min_ttl_s."""
    three_carriers(server, ttl=3600)
    assert (await srv_discovery(server, max_ttl_s=300.0).resolve()).ttl_s == 300.0
    three_carriers(server, ttl=0)
    assert (await srv_discovery(server, min_ttl_s=2.0).resolve()).ttl_s == 2.0


async def test_answer_is_cached_until_ttl_then_requeried(server: AuthoritativeDNS) -> None:
    """Within the TTL resolve() answers from cache with the time left; after it, DNS is asked again."""
    three_carriers(server, ttl=30)
    clock = FakeClock()
    discovery = srv_discovery(server, clock=clock)
    await discovery.resolve()
    clock.now += 29.5
    cached = await discovery.resolve()
    assert server.query_count(SRV_NAME, "SRV") == 1
    assert cached.endpoints == THREE
    assert cached.source == "srv"
    assert cached.ttl_s == pytest.approx(0.5)
    assert discovery.next_refresh_in() == pytest.approx(0.5)
    clock.now += 1.0
    await discovery.resolve()
    assert server.query_count(SRV_NAME, "SRV") == 2
    assert discovery.answers == {"srv": 2}  # answers from within the TTL are not new answers
    assert not discovery.failures


async def test_watch_picks_up_answer_set_change_after_ttl(server: AuthoritativeDNS) -> None:
    """watch() re-asks when the 1 s TTL runs out and reports the new two-carrier set with its new TTL."""
    three_carriers(server, ttl=1)
    seen: list[Discovered] = []
    stop = asyncio.Event()
    discovery = srv_discovery(server)
    task = asyncio.create_task(discovery.watch(seen.append, stop))
    try:
        await eventually(lambda: len(seen) == 1)
        assert seen[0].endpoints == THREE
        assert seen[0].ttl_s == 1.0
        server.set_srv(
            SRV_NAME,
            [(10, 50, 5555, "hgc.ingest.hk.example."), (20, 100, 5557, "tgt.ingest.hk.example.")],
            120,
        )
        server.set_a("hgc.ingest.hk.example.", ["127.0.0.11"], 120)
        server.set_a("tgt.ingest.hk.example.", ["127.0.0.13"], 120)
        server.remove("pccw.ingest.hk.example.")
        await eventually(lambda: len(seen) == 2)
        assert seen[1].endpoints == (THREE[0], THREE[2])
        assert seen[1].ttl_s == 120.0
        assert discovery.next_refresh_in() > 100.0
        assert server.query_count(SRV_NAME, "SRV") == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def test_watch_does_not_report_an_unchanged_answer(server: AuthoritativeDNS) -> None:
    """A re-query that returns the same endpoints does not call on_change again."""
    three_carriers(server, ttl=1)
    seen: list[Discovered] = []
    stop = asyncio.Event()
    task = asyncio.create_task(srv_discovery(server).watch(seen.append, stop))
    try:
        await eventually(lambda: server.query_count(SRV_NAME, "SRV") >= 2)
        assert len(seen) == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, BOUND_S)


async def test_watch_returns_promptly_when_stopped(server: AuthoritativeDNS) -> None:
    """Setting stop ends watch() during its TTL sleep, without waiting for the TTL."""
    three_carriers(server, ttl=300)
    seen: list[Discovered] = []
    stop = asyncio.Event()
    task = asyncio.create_task(srv_discovery(server).watch(seen.append, stop))
    await eventually(lambda: len(seen) == 1)
    stop.set()
    await asyncio.wait_for(task, 1.0)


async def test_server_down_serves_cache_within_grace_then_static() -> None:
    """With the server gone the last answer is served (source cache) until grace ends, then static."""
    clock = FakeClock()
    async with AuthoritativeDNS() as dns_server:
        three_carriers(dns_server, ttl=5)
        discovery = srv_discovery(dns_server, clock=clock, grace_s=10.0)
        assert (await discovery.resolve()).source == "srv"
        await dns_server.aclose()
        clock.now += 6.0
        cached = await discovery.resolve()
        assert cached.source == "cache"
        assert cached.endpoints == THREE
        assert cached.reason in {FailureReason.NO_NAMESERVERS, FailureReason.TIMEOUT}
        assert cached.error
        clock.now += 10.0
        fallback = await discovery.resolve()
        assert fallback.source == "static"
        assert fallback.endpoints == tuple(STATIC)
        assert fallback.error
        # What the agent exports as edge_discovery_answers_total / edge_discovery_failures_total.
        assert discovery.answers == {"srv": 1, "cache": 1, "static": 1}
        assert sum(discovery.failures.values()) == 2
        assert set(discovery.failures) <= {FailureReason.NO_NAMESERVERS.value, FailureReason.TIMEOUT.value}


async def test_cached_answer_is_retried_after_min_ttl() -> None:
    """A failed refresh is tried again after min_ttl_s, not after the old answer's TTL."""
    clock = FakeClock()
    async with AuthoritativeDNS() as dns_server:
        three_carriers(dns_server, ttl=60)
        discovery = srv_discovery(dns_server, clock=clock, min_ttl_s=2.0)
        await discovery.resolve()
        await dns_server.aclose()
        clock.now += 61.0
        await discovery.resolve()
        assert discovery.next_refresh_in() == pytest.approx(2.0)


async def test_nxdomain_falls_back_to_static(server: AuthoritativeDNS) -> None:
    """A name the server does not know gives the static list, with the NXDOMAIN reason and an error."""
    found = await srv_discovery(server).resolve()
    assert found.source == "static"
    assert found.endpoints == tuple(STATIC)
    assert found.reason is FailureReason.NXDOMAIN
    assert "nxdomain" in found.error


async def test_name_without_srv_records_falls_back_to_static(server: AuthoritativeDNS) -> None:
    """A name that exists without SRV records is a no-answer failure, served from the static list."""
    server.set_a(SRV_NAME, ["127.0.0.11"], 60)
    found = await srv_discovery(server).resolve()
    assert found.source == "static"
    assert found.reason is FailureReason.NO_ANSWER


async def test_srv_records_without_usable_targets_fall_back_to_static(server: AuthoritativeDNS) -> None:
    """SRV records whose only target is "." (service not offered) give no endpoints: static fallback."""
    server.set_srv(SRV_NAME, [(0, 0, 0, ".")], 60)
    found = await srv_discovery(server).resolve()
    assert found.source == "static"
    assert found.reason is FailureReason.NO_ENDPOINTS


async def test_static_mode_serves_static_list_without_dns(server: AuthoritativeDNS) -> None:
    """Static mode never queries and reports no error."""
    discovery = GatewayDiscovery(mode="static", static=STATIC, nameservers=[server.address])
    found = await discovery.resolve()
    assert found == Discovered(tuple(STATIC), 300.0, "static")
    assert server.total_queries == 0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": HOST_NAME, "mode": "address"}, "port"),
        ({"name": "", "mode": "srv"}, "name"),
        ({"name": SRV_NAME, "min_ttl_s": 0.0}, "min_ttl_s"),
        ({"name": SRV_NAME, "min_ttl_s": 10.0, "max_ttl_s": 5.0}, "max_ttl_s"),
        ({"name": SRV_NAME, "timeout_s": 0.0}, "timeout_s"),
        ({"name": SRV_NAME, "mode": "mdns"}, "mode"),
    ],
)
def test_bad_configuration_is_rejected_naming_the_key(kwargs: dict[str, object], key: str) -> None:
    """Each inconsistent constructor argument raises ValueError naming it."""
    with pytest.raises(ValueError, match=key):
        GatewayDiscovery(**kwargs)  # type: ignore[arg-type]  # deliberately ill-typed inputs


srv_records = st.builds(
    SrvRecord,
    priority=st.integers(0, 3),
    weight=st.integers(0, 3),
    port=st.integers(1, 3),
    target=st.sampled_from(["a.example.", "B.example.", "c.example", "b.example."]),
)


@given(st.lists(srv_records, max_size=12), st.randoms(use_true_random=False))
def test_srv_order_is_deterministic_and_follows_priority_then_weight(
    records: list[SrvRecord], rnd: random.Random
) -> None:
    """Any permutation orders the same; priority rises and, within a priority, weight never rises."""
    shuffled = list(records)
    rnd.shuffle(shuffled)
    ordered = order_srv(records)
    assert order_srv(shuffled) == ordered
    assert set(ordered) == set(records)
    for a, b in itertools.pairwise(ordered):
        assert (a.priority, -a.weight) <= (b.priority, -b.weight)


def test_shared_first_labels_get_unique_names() -> None:
    """Two targets with the same first label, or one target on two ports, still get distinct names."""
    records = order_srv(
        [
            SrvRecord(10, 0, 5555, "gw.hgc.example."),
            SrvRecord(10, 0, 5555, "gw.pccw.example."),
            SrvRecord(10, 0, 5556, "gw.hgc.example."),
        ]
    )
    addresses = {"gw.hgc.example.": ["127.0.0.11"], "gw.pccw.example.": ["127.0.0.12"]}
    names = [e.name for e in srv_endpoints(records, addresses)]
    assert names == ["gw", "gw-5556", "gw-5555"]


def test_ipv6_hosts_are_bracketed_in_endpoints() -> None:
    """IPv6 literals are bracketed; IPv4 and names are not."""
    assert endpoint_url("::1", 5555) == "tcp://[::1]:5555"
    assert endpoint_url("127.0.0.1", 5555) == "tcp://127.0.0.1:5555"


@pytest.mark.parametrize(("ttls", "expected"), [([30, 10, 20], 10.0), ([0], 1.0), ([9000], 300.0), ([], 1.0)])
def test_clamp_ttl_takes_the_smallest_within_bounds(ttls: list[float], expected: float) -> None:
    """clamp_ttl picks the smallest TTL, then clamps it to [1, 300]."""
    assert clamp_ttl(ttls, 1.0, 300.0) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1", ("127.0.0.1", 53)),
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("::1", ("::1", 53)),
        ("[::1]:5353", ("::1", 5353)),
    ],
)
def test_parse_nameserver_reads_address_and_port(text: str, expected: tuple[str, int]) -> None:
    """The config's "IP[:PORT]" nameserver strings become (ip, port) pairs."""
    assert parse_nameserver(text) == expected


@pytest.mark.parametrize("text", ["ns.example:53", "127.0.0.1:0", "[::1", "127.0.0.1:dns"])
def test_parse_nameserver_rejects_names_and_bad_ports(text: str) -> None:
    """Host names, port 0, unclosed brackets and non-numeric ports are errors."""
    with pytest.raises(ValueError, match=r".+"):
        parse_nameserver(text)


async def test_test_server_answers_nxdomain_for_unknown_names(server: AuthoritativeDNS) -> None:
    """The responder says NXDOMAIN, authoritatively, for a name its zone does not hold, and counts it."""
    query = dns.message.make_query("unknown.hk.example.", "A")
    response = await dns.asyncquery.udp(query, server.host, port=server.port, timeout=BOUND_S)
    assert response.rcode() == dns.rcode.NXDOMAIN
    assert server.query_count("unknown.hk.example.", "A") == 1


async def test_test_server_listens_on_ipv6_loopback() -> None:
    """The responder also binds ::1 and serves discovery from there."""
    async with AuthoritativeDNS(host="::1") as v6:
        three_carriers(v6)
        assert (await srv_discovery(v6).resolve()).endpoints == THREE


def test_test_server_refuses_non_loopback_addresses() -> None:
    """Binding anything but a loopback address is refused before any socket is opened."""
    with pytest.raises(ValueError, match="loopback"):
        AuthoritativeDNS(host="0.0.0.0")


async def test_test_server_close_is_safe_before_start_and_twice() -> None:
    """aclose() before start() and a second aclose() are no-ops."""
    dns_server = AuthoritativeDNS()
    await dns_server.aclose()
    await dns_server.start()
    await dns_server.aclose()
    await dns_server.aclose()
    assert dns_server.port != 0
