"""Pacing what held connections send (gateway/ingress/budget.py HeldReadPace, EdgeReader.pause): the bucket
on a fake clock, a real ROUTER's reader paused and resumed on loopback, and a gateway whose carrier reads
a held flood at its pace while another agent on the same carrier is served in between."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from edgewire import pb
from edgewire.parts import waiting
from gateway.config import BudgetConfig, ConfigError, load_config
from gateway.ingress.budget import HELD_READS_BURST, MAX_HELD_PAUSE_S, TOLD_PER_HOLD, HeldReadPace
from gateway.ingress.reader import EdgeReader
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic
from tests.gateway.test_budget import MIB, bomb, held_flooder, rejected

# ------------------------------------------------------------------------------------------ the bucket


def test_a_burst_is_read_at_once_then_one_frame_per_refill() -> None:
    """The first HELD_READS_BURST held frames cost no pause; each one after them the time the refill takes
    to pay it; time that passes pays the debt first, then fills the bucket again up to the burst."""
    pace = HeldReadPace(per_s=1000.0)
    assert [pace.take("hgc", 10.0) for _ in range(HELD_READS_BURST)] == [0.0] * HELD_READS_BURST
    assert pace.take("hgc", 10.0) == pytest.approx(0.001)
    assert pace.take("hgc", 10.0) == pytest.approx(0.001)  # read anyway: the debt stops at a millisecond
    assert pace.take("hgc", 10.002) == pytest.approx(0.0)  # the 2 ms paid the debt, and one more frame
    assert pace.take("hgc", 10.0025) == pytest.approx(0.0005)
    later = 10.0025 + 3600
    assert [pace.take("hgc", later) for _ in range(HELD_READS_BURST)] == [0.0] * HELD_READS_BURST  # not more
    assert pace.take("hgc", later) > 0


def test_carriers_are_paced_apart_and_a_rate_of_0_never_pauses() -> None:
    pace = HeldReadPace(per_s=100.0)
    for _ in range(HELD_READS_BURST):
        pace.take("hgc", 5.0)
    assert pace.take("hgc", 5.0) == pytest.approx(0.01)
    assert pace.take("pccw", 5.0) == 0.0
    unpaced = HeldReadPace(per_s=0.0)
    assert all(unpaced.take("hgc", 5.0) == 0.0 for _ in range(10 * HELD_READS_BURST))


def test_no_pause_is_longer_than_a_millisecond_or_one_frame() -> None:
    """The debt stops at a millisecond of the pace (at least one frame): every other connection of the
    carrier waits out a pause, and a carrier that reads on whatever it is told (a shard's view of the
    front's link) is not told to wait longer and longer."""
    for per_s, longest in ((5000.0, MAX_HELD_PAUSE_S), (1000.0, MAX_HELD_PAUSE_S), (100.0, 0.01)):
        pace = HeldReadPace(per_s=per_s)
        waits = [pace.take("hgc", 1.0) for _ in range(50 * HELD_READS_BURST)]
        assert max(waits) == pytest.approx(longest)


def test_the_rate_is_configured_under_budget_and_checked() -> None:
    assert BudgetConfig().held_reads_per_s == 5000.0
    assert BudgetConfig(held_reads_per_s=0).held_reads_per_s == 0.0
    for bad in (-1, 0.5, 99):  # negative; a pause of 10 ms or more per frame holds the whole carrier
        with pytest.raises(ConfigError) as info:
            load_config(environ={}, overrides={"budget": {"held_reads_per_s": bad}})
        assert {key for key, _ in info.value.problems} == {"budget.held_reads_per_s"}
    slowest = load_config(environ={}, overrides={"budget": {"held_reads_per_s": 100}})
    assert slowest.budget.held_reads_per_s == 100


# ------------------------------------------------------------------------------------------ the reader


@contextlib.contextmanager
def router_and_dealer() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A ROUTER bound on loopback and a DEALER connected to it, closed afterwards."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield router, dealer
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


async def test_a_paused_reader_reads_nothing_until_the_pause_ends_then_everything_waiting() -> None:
    """A real ROUTER on loopback: the handler pauses the reader at the third message; the burst stops there.
    While paused, messages that wait in ZeroMQ are not read, neither on their edges nor when a drain is
    asked for; when the pause ends the reader drains every one of them, in order."""
    delivered: list[bytes] = []
    reader: EdgeReader

    def deliver(frames: list[zmq.Frame]) -> None:
        delivered.append(frames[1].bytes)
        if len(delivered) == 3:
            reader.pause(2.0)  # outlasts the checks below, which wait on events, not on time

    with router_and_dealer() as (router, dealer):
        reader = EdgeReader(router, deliver, lambda exc: None, max_messages=64)
        try:
            reader.start()
            for n in range(15):
                dealer.send(b"%d" % n)
            await wait_for(lambda: len(delivered) == 3, what="three read, then the pause")
            await wait_for(lambda: waiting(router), what="the rest waiting in ZeroMQ")
            reader.schedule()  # what a send on the socket asks: not while paused
            await asyncio.sleep(0)  # one loop turn: a drain asked for would run in it
            assert reader.paused and delivered == [b"0", b"1", b"2"]
            await wait_for(lambda: len(delivered) == 15, timeout_s=10, what="the rest read after the pause")
            assert delivered == [b"%d" % n for n in range(15)]
            assert not reader.paused
        finally:
            reader.stop()


async def test_a_reader_stopped_during_a_pause_does_not_resume() -> None:
    """stop() during a pause cancels it: once the pause would have ended, a message waiting is not read."""
    delivered: list[bytes] = []
    with router_and_dealer() as (router, dealer):
        reader = EdgeReader(router, lambda frames: delivered.append(frames[1].bytes), lambda exc: None, 64)
        reader.start()
        reader.pause(0.05)
        would_resume = time.monotonic() + 0.1  # well after the pause's end (the loop's timers count ms)
        reader.stop()
        assert not reader.paused
        dealer.send(b"late")
        await wait_for(lambda: waiting(router), what="the message waiting in ZeroMQ")
        # The pause's end is a time: waited for as a condition on the clock the loop's timers read.
        await wait_for(lambda: time.monotonic() > would_resume, what="past the pause's end")
        await asyncio.sleep(0)  # one loop turn more
        assert delivered == []


# ------------------------------------------------------------------------------------------ a gateway

HELD_FLOOD = 400  # bombs sent on the flooder's connection once it is held
# At 1 MiB/s a refused 4 MiB bomb waits ~4 s: the hold outlasts the flood.
SLOW_REFILL = {"bytes_per_s": 1 * MIB, "burst_bytes": 8 * MIB, "large_frame_bytes": 4 * MIB}


async def test_a_held_flood_is_read_at_its_pace_and_another_agent_on_the_carrier_is_served_in_between(
    models_dir: Path,
) -> None:
    """A flooder on hgc: two bombs its burst admits, TOLD_PER_HOLD answered refusals, then 400 frames on its
    held connection, read at 200 a second past a burst (~1.8 s in all). A victim on the same carrier sends
    one request once the flood waits in ZeroMQ: the ROUTER reads its connections in turn, so the victim's
    frame is read after at most a held frame or two, and it is answered while most of the flood is still
    unread; the carrier's pauses are counted. Without the pace (held_reads_per_s = 0) the carrier reads the
    whole flood as fast as it can (test below)."""
    held = HELD_FLOOD
    floods = [bomb(4 * MIB, "flooder") for _ in range(2 + TOLD_PER_HOLD + held)]
    async with (
        run_gateway(models_dir=models_dir, budget={**SLOW_REFILL, "held_reads_per_s": 200.0}) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="flooder") as flooder,
        WireClient(gw.endpoint("hgc"), agent_id="victim") as victim,
    ):
        await victim.ping()  # connected and known before the flood
        for f in floods[: 2 + TOLD_PER_HOLD + 1]:
            await flooder.send_raw(f)
        ingest = gw.ingest
        assert ingest is not None
        await wait_for(lambda: len(ingest.held) == 1, what="the flooder's connection held")
        for f in floods[2 + TOLD_PER_HOLD + 1 :]:
            await flooder.send_raw(f)
        await wait_for(
            lambda: rejected(gw, "hgc", "over_budget") >= TOLD_PER_HOLD + HELD_READS_BURST + 10,
            what="the hold paced",
        )
        refused_before = rejected(gw, "hgc", "over_budget")
        answers = await asyncio.wait_for(victim.infer(fresh_requests(synthetic(1, seed=93))), timeout=5)
        refused_then = rejected(gw, "hgc", "over_budget")
        assert [a.status for a in answers] == [pb.STATUS_OK]
        # Answered while most of the held flood waited unread: the pace held it, the victim went between.
        assert refused_then < TOLD_PER_HOLD + held / 2, (refused_before, refused_then)
        pauses = gw.metrics.registry.get_sample_value("hkgw_carrier_read_pauses_total", {"carrier": "hgc"})
        assert pauses is not None and pauses >= 10
        await wait_for(lambda: rejected(gw, "hgc", "over_budget") == TOLD_PER_HOLD + held, timeout_s=30)
        assert rejected(gw, "pccw", "over_budget") == 0


async def test_unpaced_a_held_flood_is_read_as_fast_as_it_comes(models_dir: Path) -> None:
    """held_reads_per_s = 0: the same flood is read without a pause (none counted), in well under the
    ~1.8 s that 200 a second would take."""
    async with (
        run_gateway(models_dir=models_dir, budget={**SLOW_REFILL, "held_reads_per_s": 0.0}) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="flooder") as flooder,
    ):
        for _ in range(2 + TOLD_PER_HOLD + HELD_FLOOD):
            await flooder.send_raw(bomb(4 * MIB, "flooder"))
        await wait_for(lambda: rejected(gw, "hgc", "over_budget") == TOLD_PER_HOLD + HELD_FLOOD, timeout_s=30)
        assert gw.metrics.registry.get_sample_value("hkgw_carrier_read_pauses_total", {"carrier": "hgc"}) in (
            None,
            0.0,
        )


async def test_a_lapsed_hold_is_taken_up_again_by_a_frame_the_budget_refuses(models_dir: Path) -> None:
    """Once a held connection's hold ends, its agent's next batch is checked against the budget as it is
    read: one the budget refuses holds the connection again, refused unanswered (the agent was told and
    went on), not decompressed; once the budget takes its frames again, a request there is served."""
    # 4 MiB/s: a refused 4 MiB bomb waits ~1 s; a 16 MiB one costs more than the bucket, so it waits for a
    # full one (8 MiB, ~2 s from empty).
    budget = {"bytes_per_s": 4 * MIB, "burst_bytes": 8 * MIB, "large_frame_bytes": 4 * MIB}
    async with held_flooder(models_dir, budget, 5) as (gw, ingest, agent):
        [(carrier, routing_id)] = ingest.held.connections()
        state = ingest.held.state(carrier, routing_id, "flooder", ingest._clock())
        assert state is not None
        ends = state[0]
        await wait_for(lambda: ingest._clock() > ends, timeout_s=30, what="the hold over")
        told_before = len(agent.acks)
        await agent.send_raw(bomb(16 * MIB, "flooder"))
        await agent.ping()  # after the bomb was handled
        assert rejected(gw, "hgc", "over_budget") == TOLD_PER_HOLD + 6
        assert rejected(gw, "hgc", "payload_invalid") == 2  # not decompressed
        assert len(agent.acks) == told_before  # unanswered
        state = ingest.held.state(carrier, routing_id, "flooder", ingest._clock())
        assert state is not None and state[0] > ingest._clock()  # held again
        again = state[0]
        await wait_for(lambda: ingest._clock() > again, timeout_s=30, what="the second hold over")
        answers = await agent.infer(fresh_requests(synthetic(1, seed=94)))
    assert [a.status for a in answers] == [pb.STATUS_OK]
