"""Answers follow the agent (issue 23 item 2): an answer goes on the carrier the agent asks on, a re-ask of a
request accepted earlier is answered once without running it again, and across a black-holed carrier every
request is answered once, from a gateway that ran it once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import pytest
import zmq
import zmq.asyncio

from bench.blackhole import BlackHole, unavailable
from edge_agent.agent import EdgeAgent
from edge_agent.synthetic import SyntheticTraffic
from edge_agent.uplink import Outstanding
from edgewire import FrameCodec, new_id, now_unix_us, pb
from gateway.server import Gateway
from gateway.testing import FaultInjectingBackend, WireClient, fault_injecting_pools, run_gateway, wait_for
from inference.backends.base import InferCall, InferResult
from tests.edge_agent.conftest import agent_config

DEADLINE_S = 30.0


def slow_backends(**extra: Any) -> dict[str, Any]:
    """Every pool on fault-injecting wrappers of the null backend (the demo models), for a Gate to hold."""
    return fault_injecting_pools({"type": "null"}, **extra)


class Gate:
    """Holds every backend call of a gateway until opened: requests stay accepted and running, and their
    answers come out when the test says (no timing guesses)."""

    def __init__(self, gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = asyncio.Event()
        self.held = 0
        for backend in gw.backends.values():
            assert isinstance(backend, FaultInjectingBackend)
            monkeypatch.setattr(backend, "infer", self._hold(backend.infer))

    def _hold(self, infer: Any) -> Any:
        async def held(call: InferCall) -> InferResult:
            self.held += 1
            await self.opened.wait()
            result: InferResult = await infer(call)
            return result

        return held

    def open(self) -> None:
        self.opened.set()


def total(gw: Gateway, sample: str, **labels: str) -> float:
    """The sum of a metric's samples named ``sample`` over all label values (those given must match)."""
    return sum(
        s.value
        for family in gw.metrics.registry.collect()
        for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def synthetic(n: int, seed: int) -> list[pb.InferRequest]:
    """``n`` synthetic requests with fresh ids and 30 s deadlines."""
    deadline = now_unix_us() + int(DEADLINE_S * 1e6)
    out = [g.request for g in SyntheticTraffic(seed, regions=("us-west",)).take(n)]
    for r in out:
        r.request_id = new_id()
        r.deadline_unix_us = deadline
        r.priority = pb.PRIORITY_CLASS_INTERACTIVE
    return out


def ids_of(requests: Iterable[pb.InferRequest]) -> list[bytes]:
    return [r.request_id for r in requests]


async def settled(client: WireClient) -> None:
    """Whatever the gateway sent this client before now has been read: a Pong comes after it."""
    await client.ping()


# ----------------------------------------------------------- the gateway half: one agent on two carriers


async def test_answer_to_a_reask_goes_to_the_carrier_it_came_on(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request still running is re-asked for on pccw while the agent's pings still reach the gateway on
    hgc (a carrier whose way back is broken): joined, not run again, and answered on pccw only."""
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        gate = Gate(gw, monkeypatch)
        requests = synthetic(6, seed=41)
        async with (
            WireClient(gw.endpoint("hgc"), agent_id="a1") as first,
            WireClient(gw.endpoint("pccw"), agent_id="a1") as moved,
        ):
            accepted = await first.wait_ack(await first.send(requests))
            await wait_for(lambda: gate.held > 0, what="the requests running")
            reask = await moved.wait_ack(await moved.send(requests))
            await settled(first)  # hgc is now the carrier the gateway heard from last
            gate.open()
            answers = await moved.wait_responses(ids_of(requests))
            await settled(first)
        executed = total(gw, "hkgw_batch_size_sum")
    assert sorted(accepted.accepted_ids) == sorted(ids_of(requests))
    assert sorted(reask.duplicate_ids) == sorted(ids_of(requests)) and not reask.accepted_ids
    assert {a.status for a in answers} == {pb.STATUS_OK}
    assert first.responses == {} and moved.duplicate_responses == 0
    assert executed == len(requests)


async def test_an_answer_goes_on_its_requests_carrier_not_the_agents_latest(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request asked on hgc is answered on hgc though the agent has since sent other requests on pccw:
    the agent re-asks for what it sent on a carrier it lost, so its answer must not be sent elsewhere."""
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        gate = Gate(gw, monkeypatch)
        on_hgc, on_pccw = synthetic(4, seed=44), synthetic(4, seed=45)
        async with (
            WireClient(gw.endpoint("hgc"), agent_id="a4") as first,
            WireClient(gw.endpoint("pccw"), agent_id="a4") as second,
        ):
            await first.wait_ack(await first.send(on_hgc))
            await second.wait_ack(await second.send(on_pccw))
            gate.open()
            await first.wait_responses(ids_of(on_hgc))
            await second.wait_responses(ids_of(on_pccw))
            await settled(first)
            await settled(second)
    assert set(first.responses) == set(ids_of(on_hgc))
    assert set(second.responses) == set(ids_of(on_pccw))


async def test_a_copy_delivered_late_moves_no_answer(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames the agent sent before the ones a route was learnt from, delivered late (TCP after a black-hole
    lifts, on the connection the agent has left): a late copy of a running request on pccw does not take
    its answer off hgc, and a late ping on a second hgc connection does not take hgc's route."""
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        gate = Gate(gw, monkeypatch)
        requests = synthetic(4, seed=46)
        early = now_unix_us() - 5_000_000
        async with (
            WireClient(gw.endpoint("hgc"), agent_id="a5") as current,
            WireClient(gw.endpoint("hgc"), agent_id="a5") as old_hgc,
            WireClient(gw.endpoint("pccw"), agent_id="a5") as old_pccw,
        ):
            await current.wait_ack(await current.send(requests))
            late_copy = old_pccw.codec.encode(
                pb.RequestBatch(requests=requests), agent_id="a5", message_id=new_id(), sent_at_unix_us=early
            )
            await old_pccw.send_raw(late_copy)
            late_ping = old_hgc.codec.encode(pb.Ping(nonce=1), agent_id="a5", sent_at_unix_us=early)
            await old_hgc.send_raw(late_ping)
            await wait_for(lambda: total(gw, "hkgw_requests_duplicate_total") == len(requests))
            assert await old_hgc.receive_one(5.0)  # its Pong: the late ping was handled
            gate.open()
            answers = await current.wait_responses(ids_of(requests))
            await settled(old_pccw)
            await settled(old_hgc)
    assert {a.status for a in answers} == {pb.STATUS_OK}
    assert old_pccw.responses == {} and old_hgc.responses == {}


async def test_reask_of_an_answer_no_longer_cached_is_answered_with_an_error(models_dir: Path) -> None:
    """A re-ask for a request answered already whose answer the response cache no longer holds gets an
    explicit INTERNAL answer at once (counted), not silence until its deadline and not a second run."""
    async with run_gateway(models_dir=models_dir, dedupe={"response_cache_bytes": 0}) as gw:
        requests = synthetic(4, seed=42)
        async with WireClient(gw.endpoint("hgc"), agent_id="a2") as first:
            original = await first.infer(requests)
        executed = total(gw, "hkgw_batch_size_sum")
        async with WireClient(gw.endpoint("tgt"), agent_id="a2") as moved:
            ack = await moved.wait_ack(await moved.send(requests))
            again = await moved.wait_responses(ids_of(requests), timeout_s=10)
        executed_after = total(gw, "hkgw_batch_size_sum")
        not_cached = total(gw, "hkgw_replies_undeliverable_total", reason="not_cached")
    assert {r.status for r in original} == {pb.STATUS_OK}
    assert sorted(ack.duplicate_ids) == sorted(ids_of(requests))
    assert {r.status for r in again} == {pb.STATUS_INTERNAL}
    assert all("no longer in the gateway's response cache" in r.error_message for r in again)
    assert executed_after == executed == len(requests)
    assert not_cached == len(requests)


async def test_answers_leave_a_carrier_not_heard_from_past_the_heartbeat_timeout(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests asked on hgc, which then goes silent for longer than the ZMTP heartbeat timeout while the
    agent is heard on pccw: the answers go to pccw, and are counted as moved."""
    zmq_section = {"heartbeat_ivl_ms": 100, "heartbeat_timeout_ms": 300}
    async with run_gateway(models_dir=models_dir, **slow_backends(zmq=zmq_section)) as gw:
        gate = Gate(gw, monkeypatch)
        silent_after = gw.carriers["hgc"].silent_after_s
        requests = synthetic(5, seed=43)
        loop = asyncio.get_running_loop()
        async with (
            WireClient(gw.endpoint("hgc"), agent_id="a3") as first,
            WireClient(gw.endpoint("pccw"), agent_id="a3") as live,
        ):
            await first.wait_ack(await first.send(requests))
            last_heard_on_hgc = loop.time()
            while loop.time() - last_heard_on_hgc <= 2 * silent_after:  # the agent pings on pccw only
                await live.ping()
            gate.open()
            answers = await live.wait_responses(ids_of(requests))
            await settled(first)
        moved = gw.metrics.registry.get_sample_value("hkgw_replies_moved_total")
    assert silent_after == 0.3
    assert {a.status for a in answers} == {pb.STATUS_OK}
    assert first.responses == {}
    assert moved == len(requests)  # exported for operators, not only kept by the reply router


# ----------------------------------------------------------- both halves: a real agent, a black-hole


class Caller:
    """A service calling the agent's intake on a raw DEALER: every answer counted by request id."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._codec = FrameCodec()
        self.answers: Counter[bytes] = Counter()
        self.statuses: Counter[int] = Counter()
        self._reader = asyncio.create_task(self._read())

    async def send(self, requests: list[pb.InferRequest]) -> None:
        await self._sock.send_multipart(
            self._codec.encode(pb.RequestBatch(requests=requests), agent_id="svc")
        )

    async def _read(self) -> None:
        while True:
            decoded = self._codec.decode(await self._sock.recv_multipart())
            if isinstance(decoded.payload, pb.ResponseBatch):
                for response in decoded.payload.responses:
                    self.answers[response.request_id] += 1
                    self.statuses[response.status] += 1

    async def aclose(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()


def reasked(entry: Outstanding | None, lost: str) -> bool:
    """Sent again on another carrier than ``lost`` and acknowledged there."""
    return entry is not None and entry.accepted and entry.carrier != lost


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("direction", ["both", "from"])
@pytest.mark.parametrize("answered", ["before_the_reask", "after_the_reask"])
async def test_black_holed_carrier_strands_no_answer(
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    direction: Literal["both", "from"],
    answered: str,
) -> None:
    """The agent's carrier is black-holed (its packets dropped, both ways or only towards the agent; TCP
    still up) while a send window's worth of requests the gateway accepted on it are running, and 40 more
    wait for room. The answers come out before the agent re-asks (into the dead carrier: re-asked,
    answered from the cache) or after (joined): every request answered once, none DEADLINE_EXCEEDED, each
    accepted and run once; the re-asks did not wait for room in the window (nothing would open it)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        gate = Gate(gw, monkeypatch)
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        config = agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        async with EdgeAgent(config) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            caller = Caller(agent.intake_endpoint)
            try:
                # As many as the send window lets the gateway hold: the second batch waits for room.
                first = synthetic(config.uplink.send_window_initial, seed=31)
                await caller.send(first)
                ids = set(ids_of(first))
                await wait_for(
                    lambda: all((e := uplink.outstanding.get(i)) is not None and e.accepted for i in ids),
                    timeout_s=15,
                    what="the first requests accepted",
                )
                second = synthetic(40, seed=32)
                await caller.send(second)
                ids |= set(ids_of(second))
                await wait_for(
                    lambda: uplink.inflight == len(ids) and uplink.stats.window_full > 0,
                    what="the second batch waiting for room in the send window",
                )
                # The carrier to black-hole: the one holding most of the first batch's requests (frames
                # go on the agent's best carrier, which may change while it measures its carriers: the
                # best one now may hold none of them). What the black-hole strands: those requests.
                on = Counter(e.carrier for i in ids_of(first) if (e := uplink.outstanding.get(i)) is not None)
                victim = uplink.carriers[on.most_common(1)[0][0]]
                stranded = [
                    i for i in ids_of(first) if (e := uplink.outstanding.get(i)) and e.carrier == victim.name
                ]
                assert stranded
                with BlackHole(port_of(victim.endpoint), direction):
                    if answered == "after_the_reask":
                        # All of them asked for again on another carrier, and acked there.
                        await wait_for(
                            lambda: all(reasked(uplink.outstanding.get(i), victim.name) for i in stranded),
                            timeout_s=15,
                            what="the agent's re-ask",
                        )
                    gate.open()
                    await wait_for(
                        lambda: set(caller.answers) >= ids, timeout_s=DEADLINE_S + 10, what="every answer"
                    )
                executed = total(gw, "hkgw_batch_size_sum")
                accepted = total(gw, "hkgw_requests_accepted_total")
                responded = total(gw, "hkgw_responses_total")
                resent = dict(uplink.stats.resent)
            finally:
                await caller.aclose()
    assert set(caller.answers) == ids and set(caller.answers.values()) == {1}
    assert caller.statuses == Counter({pb.STATUS_OK: len(ids)})
    # Accepted, run and answered once each: the re-asks were duplicates, joined or answered from the cache.
    assert executed == accepted == responded == len(ids)
    assert resent.get("carrier_down", 0) >= len(stranded)  # the re-ask: accepted on the lost carrier
