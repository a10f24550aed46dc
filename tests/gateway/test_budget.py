"""Each agent's cost budget (gateway/ingress/budget.py): the bucket arithmetic on a fake clock, the
defaults against honest traffic and a bomb flood, and a real gateway refusing an over-budget agent's
frames before decompression while another agent is served."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zstandard as zstd
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, new_id, now_unix_us, pb
from gateway.config import BudgetConfig, ConfigError, load_config
from gateway.ingest import Ingest
from gateway.ingress.budget import (
    CONTROL_FREE_BYTES,
    LAPSED_KEEP_S,
    MAX_HELD,
    TOLD_PER_HOLD,
    AgentBudgets,
    HeldConnections,
    over_budget_ack,
    retry_after_ms,
)
from gateway.server import Gateway
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic

MIB = 1 << 20


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def budgets(clock: FakeClock, **changes: Any) -> AgentBudgets:
    """Budgets with these settings, every frame costing its size unless ``large_frame_bytes`` is given."""
    return AgentBudgets(BudgetConfig(**{"large_frame_bytes": 1 << 40, **changes}), clock)


# ------------------------------------------------------------------------------------------ the buckets


def test_a_new_agent_starts_full_and_waits_for_the_refill_of_what_it_declares() -> None:
    """A fresh agent gets its burst at once; the next frame waits (declared - balance) / rate seconds."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=4 * MIB)
    assert b.admit("a", 4 * MIB) is None
    b.charge("a", 4 * MIB, 0.001)
    assert b.admit("a", MIB) == pytest.approx(1.0)
    clock.now += 0.5
    assert b.admit("a", MIB) == pytest.approx(0.5)
    clock.now += 0.5
    assert b.admit("a", MIB) is None
    assert b.balance("a") == pytest.approx((1.0 * MIB, 0.5))  # the decode bucket refilled long ago


def test_the_refill_stops_at_the_burst() -> None:
    """An idle agent saves up no more than its burst, of bytes and of decode time."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=2 * MIB, decode_s_per_s=0.5, burst_decode_s=0.25)
    b.charge("a", 2 * MIB, 0.25)
    clock.now += 3600
    assert b.balance("a") == pytest.approx((2.0 * MIB, 0.25))


def test_an_agent_in_decode_debt_is_refused_until_it_is_paid_back() -> None:
    """A frame whose decode took longer than the bucket held leaves a debt; its agent is refused, whatever
    it declares, until the refill has paid it: debt / decode_s_per_s."""
    clock = FakeClock()
    b = budgets(clock, decode_s_per_s=0.5, burst_decode_s=0.5)
    assert b.admit("a", 100) is None
    b.charge("a", 100, 2.0)  # 1.5 s in debt
    assert b.admit("a", 0) == pytest.approx(3.0)
    clock.now += 2.9
    assert b.admit("a", 100) == pytest.approx(0.1)
    clock.now += 0.1
    assert b.admit("a", 100) is None


def test_a_frame_larger_than_the_bucket_goes_when_the_bucket_is_full() -> None:
    """A frame declaring more than burst_bytes is not refused for ever: it needs a full bucket, and leaves
    the agent in debt for the rest."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=2 * MIB)
    assert b.admit("a", 8 * MIB) is None
    b.charge("a", 8 * MIB, 0.0)  # 6 MiB in debt
    assert b.admit("a", 8 * MIB) == pytest.approx(8.0)  # back to a full 2 MiB
    clock.now += 8
    assert b.admit("a", 8 * MIB) is None


def test_a_frame_over_large_frame_bytes_costs_the_square_of_its_size() -> None:
    """Up to large_frame_bytes a frame costs its size; beyond, size x size / large_frame_bytes (twice the
    size, four times the cost); a raw payload (nothing decompressed) costs nothing."""
    b = budgets(FakeClock(), large_frame_bytes=1 * MIB)
    assert b.cost(0) == 0
    assert b.cost(300_000) == 300_000
    assert b.cost(1 * MIB) == 1 * MIB
    assert b.cost(2 * MIB) == 4 * MIB
    assert b.cost(32 * MIB) == 1024 * MIB


def test_small_control_frames_are_admitted_in_debt_and_large_ones_are_not() -> None:
    """A Ping or DictionaryRequest of at most CONTROL_FREE_BYTES always goes (refused, it would look like a
    lost Pong), a larger one is budgeted like a batch."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=1 * MIB)
    b.charge("a", 3 * MIB, 0.0)
    assert b.admit("a", 40, control=True) is None
    assert b.admit("a", CONTROL_FREE_BYTES, control=True) is None
    assert b.admit("a", CONTROL_FREE_BYTES + 1, control=True) is not None
    assert b.admit("a", 40) is not None


def test_agents_have_buckets_of_their_own() -> None:
    """One agent's debt refuses none of another's frames."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=1 * MIB)
    b.charge("attacker", 32 * MIB, 5.0)
    assert b.admit("attacker", 1000) is not None
    assert b.admit("victim", 1 * MIB) is None


def test_at_most_max_agents_are_tracked_least_recently_seen_first_out() -> None:
    """The table is bounded: a third agent evicts the one seen longest ago, which comes back full."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1, burst_bytes=1000, max_agents=2)
    b.charge("a", 1000, 0.0)
    b.charge("b", 1000, 0.0)
    assert b.admit("a", 10) is not None  # "a" seen again: "b" is now the oldest
    b.charge("c", 10, 0.0)
    assert len(b) == 2 and b.evicted == 1
    assert b.balance("b") is None
    assert b.balance("a") is not None
    assert b.admit("b", 1000) is None  # forgotten, so full again


def test_disabled_budgets_admit_everything_and_track_nothing() -> None:
    """``enabled = false`` turns the mechanism off."""
    b = budgets(FakeClock(), enabled=False, bytes_per_s=1, burst_bytes=1)
    b.charge("a", 32 * MIB, 10.0)
    assert b.admit("a", 32 * MIB) is None
    assert len(b) == 0


def test_a_clock_that_steps_back_refills_nothing() -> None:
    """An injected clock that goes backwards neither refills nor raises."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=1 * MIB)
    b.charge("a", 1 * MIB, 0.0)
    clock.now -= 10
    assert b.admit("a", MIB) == pytest.approx(1.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 8 * MIB),  # declared bytes
            st.booleans(),  # a control frame
            st.floats(0.0, 0.2),  # decode time charged once it is done
            st.floats(0.0, 1.0),  # seconds until the next frame
        ),
        max_size=40,
    ),
    st.integers(1, 3),  # max_agents
)
def test_take_is_admit_then_charge_of_the_declared_bytes(
    frames: list[tuple[str, int, bool, float, float]], max_agents: int
) -> None:
    """take() leaves every agent's buckets and answers each frame as admit() then, when it admits,
    charge() of the declared bytes (the gateway's two calls before it) does, evictions included."""
    one_clock, two_clock = FakeClock(), FakeClock()
    settings_ = {
        "bytes_per_s": 2 * MIB,
        "burst_bytes": 4 * MIB,
        "large_frame_bytes": MIB,
        "max_agents": max_agents,
    }
    one, two = budgets(one_clock, **settings_), budgets(two_clock, **settings_)
    for agent, declared, control, decode_s, gap in frames:
        wait = one.admit(agent, declared, control=control)
        if wait is None:
            one.charge(agent, declared, 0.0)
        assert two.take(agent, declared, control=control) == wait
        if wait is None:  # decoded: its time charged, as the gateway does once the decode is done
            one.charge(agent, 0, decode_s)
            two.charge(agent, 0, decode_s)
        one_clock.now += gap
        two_clock.now += gap
        assert len(one) == len(two) and one.evicted == two.evicted
        for name in "abc":
            assert one.balance(name) == two.balance(name)


def test_retry_after_is_whole_milliseconds_rounded_up_and_never_zero() -> None:
    """0 on the wire means 'no retry-after': a wait of a microsecond is told as 1 ms."""
    assert retry_after_ms(1e-9) == 1
    assert retry_after_ms(0.0101) == 11
    assert retry_after_ms(2.0) == 2000
    assert retry_after_ms(1e12) == (1 << 32) - 1
    ack = over_budget_ack(b"m" * 16, 0.25)
    assert (ack.frame_reject, ack.frame_retry_after_ms) == (pb.REJECT_REASON_OVER_BUDGET, 250)
    assert ack.frame_reject_detail == "agent over its cost budget"


def test_an_agent_is_told_to_wait_only_so_often_per_hold() -> None:
    """The first TOLD_PER_HOLD refusals of a hold get an Ack, the rest of it none; the next hold, after the
    first refusal's retry-after, is told again."""
    clock = FakeClock()
    b = budgets(clock, bytes_per_s=1 * MIB, burst_bytes=1 * MIB)
    b.charge("a", 2 * MIB, 0.0)
    told = [b.tell("a", 2.0) for _ in range(TOLD_PER_HOLD + 10)]
    assert told == [True] * TOLD_PER_HOLD + [False] * 10
    clock.now += 1.99
    assert not b.tell("a", 2.0)
    clock.now += 0.01
    assert b.tell("a", 2.0)


# ------------------------------------------------------------------------------------- the defaults


def honest_frames(n: int) -> list[int]:
    """Declared (uncompressed) lengths of frames of 100 requests of the synthetic ranking + text + image
    mix, as the agent sends them."""
    codec = FrameCodec()
    traffic = [g.request for g in SyntheticTraffic(7).take(100 * n)]
    lengths = []
    for i in range(n):
        header, _ = codec.encode(pb.RequestBatch(requests=traffic[100 * i : 100 * (i + 1)]))
        lengths.append(pb.Envelope.FromString(header).uncompressed_length)
    return lengths


def test_the_defaults_never_refuse_honest_frames_of_100_at_20k_records_a_second() -> None:
    """30 s of 200 frames/s of 100 synthetic requests (the mix, images included), each charged twice the
    decode time measured for such a frame (0.5 ms, docs/GATEWAY.md): not one refused."""
    clock = FakeClock()
    b = AgentBudgets(BudgetConfig(), clock)
    sizes = honest_frames(10)
    assert 150_000 < sum(sizes) / len(sizes) < 400_000  # what a frame of 100 of this mix declares
    refused = 0
    for i in range(200 * 30):
        clock.now += 1 / 200
        declared = sizes[i % len(sizes)]
        if b.admit("honest", declared) is not None:
            refused += 1
        else:
            b.charge("honest", declared, 0.001)
    assert refused == 0


def test_the_defaults_hold_a_bomb_flood_to_one_frame_in_4_seconds() -> None:
    """185 frames/s declaring 32 MiB each for 30 s: each costs 32 x its size (a GiB) at 256 MiB/s, so
    eight are decompressed, not 5,550; the rest are refused with a retry-after no longer than that refill."""
    clock = FakeClock()
    config = BudgetConfig()
    b = AgentBudgets(config, clock)
    admitted, waits = 0, []
    for _ in range(185 * 30):
        clock.now += 1 / 185
        wait = b.admit("bomber", 32 * MIB)
        if wait is None:
            admitted += 1
            b.charge("bomber", 32 * MIB, 0.015)
        else:
            waits.append(wait)
    assert admitted == 1 + math.floor(30 * config.bytes_per_s / b.cost(32 * MIB)) == 8
    assert max(waits) <= b.cost(32 * MIB) / config.bytes_per_s == 4.0


def test_bad_budget_values_name_their_key() -> None:
    """A zero rate is refused at its key, like every config mistake."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides={"budget": {"bytes_per_s": 0, "max_agents": 0}})
    assert {key for key, _ in info.value.problems} == {"budget.bytes_per_s", "budget.max_agents"}


# ----------------------------------------------------------------------------------- a real gateway


@functools.cache
def zeros_zstd(n: int) -> bytes:
    return zstd.ZstdCompressor(level=3, write_content_size=True).compress(bytes(n))


def bomb(declared: int, agent_id: str) -> list[bytes]:
    """A frame honestly declaring ``declared`` bytes of zeros: ~1 KB of zstd, every codec limit kept (the
    zeros do not parse as a RequestBatch once decompressed: payload_invalid)."""
    body = zeros_zstd(declared)
    envelope = pb.Envelope(
        schema_version=1,
        message_id=new_id(),
        agent_id=agent_id,
        region="us-west",
        kind=pb.MESSAGE_KIND_REQUEST_BATCH,
        codec=pb.CODEC_ZSTD,
        uncompressed_length=declared,
        sent_at_unix_us=now_unix_us(),
    )
    return [envelope.SerializeToString(), body]


def rejected(gw: Gateway, carrier: str, label: str) -> float:
    labels_ = {"carrier": carrier, "reason": label}
    return gw.metrics.registry.get_sample_value("hkgw_frames_rejected_total", labels_) or 0.0


@contextlib.asynccontextmanager
async def held_flooder(
    models_dir: Path, budget: dict[str, Any], past: int
) -> AsyncIterator[tuple[Gateway, Ingest, WireClient]]:
    """A gateway with this ``[budget]`` and an agent "flooder" on hgc that has sent two bombs of 4 MiB a
    burst of 8 MiB admits, then TOLD_PER_HOLD + ``past`` more, all of those refused over_budget and a Ping
    after them answered (every refusal's Ack came first): its connection is held."""
    async with (
        run_gateway(models_dir=models_dir, budget=budget) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="flooder") as agent,
    ):
        assert gw.ingest is not None
        for _ in range(2 + TOLD_PER_HOLD + past):
            await agent.send_raw(bomb(4 * MIB, "flooder"))
        refused = TOLD_PER_HOLD + past
        await wait_for(lambda: rejected(gw, "hgc", "over_budget") == refused, what="the flood refused")
        await agent.ping()
        yield gw, gw.ingest, agent


# 8 MiB of burst for bombs of 4 MiB, each costing its size; the refill (64 KiB/s) gives a third one only
# after a minute.
TIGHT = {"bytes_per_s": 64 << 10, "burst_bytes": 8 * MIB, "large_frame_bytes": 4 * MIB}


async def test_an_over_budget_agent_is_refused_before_decompression_and_told_when_to_retry(
    models_dir: Path,
) -> None:
    """Of 12 bombs of 4 MiB the burst decompresses two (payload_invalid); the other ten are refused
    over_budget before decompression, each with an Ack naming its frame and a retry-after; the agent's
    small Pings are still answered."""
    frames = [bomb(4 * MIB, "attacker") for _ in range(12)]
    async with (
        run_gateway(models_dir=models_dir, budget=TIGHT) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="attacker") as attacker,
    ):
        for f in frames:
            await attacker.send_raw(f)
        # The two admitted ones are decompressed off the loop (4 MiB: limits.inflate_off_loop_bytes), and
        # refused when they are back; their bytes were charged when they were admitted. The frames wait for
        # their turns (the gateway's backlog); each is admitted then.
        await wait_for(lambda: rejected(gw, "hgc", "payload_invalid") >= 2, what="the two bombs refused")
        await wait_for(lambda: rejected(gw, "hgc", "over_budget") >= 10, what="the ten refused")
        await attacker.ping()  # answers to one connection keep their order: every refusal's Ack came first
        assert rejected(gw, "hgc", "payload_invalid") == 2
        assert rejected(gw, "hgc", "over_budget") == 10
        refusals = [attacker.acks[pb.Envelope.FromString(f[0]).message_id] for f in frames[2:]]
        assert {a.frame_reject for a in refusals} == {pb.REJECT_REASON_OVER_BUDGET}
        # 4 MiB at 64 KiB/s: about a minute; never 0 (no retry-after) and never more than the refill.
        assert all(1000 < a.frame_retry_after_ms <= 64_001 for a in refusals)
        assert not any(a.accepted_ids or a.nacks for a in refusals)


async def test_an_agent_flooding_past_its_told_refusals_is_held_until_the_hold_ends(models_dir: Path) -> None:
    """Past the TOLD_PER_HOLD answered refusals of a hold, the agent's request batches on that connection are
    refused over_budget before anything else is read of them, whatever they declare, until the hold ends:
    a small batch its bytes bucket would take is refused then (counted, unanswered), its Ping still answered;
    once the hold is over the same request is served."""
    request = synthetic(1, seed=92)
    # At 1 MiB/s a refused 4 MiB frame waits ~4 s: the hold outlasts the flood on a slow machine too.
    budget = {"bytes_per_s": 1 * MIB, "burst_bytes": 8 * MIB, "large_frame_bytes": 4 * MIB}
    async with held_flooder(models_dir, budget, 10) as (gw, ingest, agent):
        refused = TOLD_PER_HOLD + 10
        told = [a for a in agent.acks.values() if a.frame_reject == pb.REJECT_REASON_OVER_BUDGET]
        assert len(told) == TOLD_PER_HOLD
        ends = ingest.budgets.hold_ends("flooder")
        assert ends > time.monotonic() + 0.5, "the hold ended before the test could look at it"
        header, _ = agent.codec.encode(pb.RequestBatch(requests=request))
        envelope = pb.Envelope.FromString(header)
        declared = envelope.uncompressed_length if envelope.codec == pb.CODEC_ZSTD else 0
        assert ingest.budgets.admit("flooder", declared) is None  # its budget alone would take this frame
        assert gw.metrics.registry.get_sample_value("hkgw_held_connections") == 1.0  # the scrape's gauge
        small = await agent.send(request)
        await agent.ping()  # the hold refuses batches only: a Ping is answered, after the batch was handled
        assert rejected(gw, "hgc", "over_budget") == refused + 1
        assert small not in agent.acks
        # The hold ends at a time: waited for as a condition on the clock the gateway reads.
        await wait_for(lambda: ingest._clock() > ends, timeout_s=30, what="the hold over")
        answers = await agent.infer(fresh_requests(request))
        assert gw.metrics.registry.get_sample_value("hkgw_held_connections") == 0.0  # lapsed: not held
    assert [a.status for a in answers] == [pb.STATUS_OK]


def test_held_now_counts_the_holds_not_yet_ended() -> None:
    """``held_now`` (the hkgw_held_connections gauge) counts connections whose hold has not ended at the
    time asked: not the lapsed ones still remembered, whichever carrier or agent."""
    held = HeldConnections()
    assert held.held_now(0.0) == 0
    held.hold("hgc", b"\x01", "flooder", 10.0)
    held.hold("pccw", b"\x01", "flooder", 20.0)
    held.hold("hgc", b"\x02", "other", 30.0)
    assert [held.held_now(t) for t in (9.9, 10.0, 25.0, 30.0)] == [3, 2, 1, 0]
    assert len(held) == 3  # the lapsed ones are still remembered
    held.release("hgc", b"\x02")
    assert held.held_now(0.0) == 2


def test_held_connections_are_bounded_oldest_first() -> None:
    """At most ``limit`` connections are held; a new hold forgets the oldest (whose frames then take the
    whole path again and are refused there), a connection held again becomes the newest."""
    held = HeldConnections(limit=2)
    for n in range(5):
        held.hold("hgc", bytes([n]), f"agent-{n}", 60.0)
    assert held.connections() == [("hgc", b"\x03"), ("hgc", b"\x04")]
    held.hold("hgc", b"\x03", "agent-3", 60.0)
    held.hold("pccw", b"\x03", "agent-3", 60.0)
    assert held.connections() == [("hgc", b"\x03"), ("pccw", b"\x03")]
    assert HeldConnections().limit == MAX_HELD


def test_a_hold_refuses_only_its_agent_on_its_connection_until_it_ends() -> None:
    """A held connection refuses frames naming the agent it was held for, on that carrier and connection,
    until the hold's end; then the hold lapses, remembered for LAPSED_KEEP_S (the gateway checks the
    connection's frames against the budget as they are read), then it is forgotten. Released one by one or
    all at once."""
    held = HeldConnections()
    held.hold("hgc", b"\x01", "flooder", 10.0)
    assert held.state("hgc", b"\x01", "flooder", 9.9) == (10.0, "flooder")  # held: before its end
    assert held.state("hgc", b"\x01", "other", 9.9) is None  # another agent's envelope on it: the whole path
    assert held.state("pccw", b"\x01", "flooder", 9.9) is None  # the same routing id on another carrier
    assert held.state("hgc", b"\x02", "flooder", 9.9) is None
    assert len(held) == 1
    assert held.state("hgc", b"\x01", "flooder", 10.0) == (10.0, "flooder")  # ended: lapsed, remembered
    assert held.state("hgc", b"\x01", "other", 10.0) is None
    assert held.state("hgc", b"\x01", "flooder", 10.0 + LAPSED_KEEP_S) is None  # then forgotten
    assert len(held) == 0
    held.hold("hgc", b"\x01", "envelope-id", 10.0, owner="key-id")  # the budget's agent: the key's
    assert held.state("hgc", b"\x01", "envelope-id", 9.0) == (10.0, "key-id")
    held.hold("hgc", b"\x01", "flooder", 10.0)
    held.hold("hgc", b"\x02", "flooder", 10.0)
    held.release("hgc", b"\x01")
    assert held.connections() == [("hgc", b"\x02")]
    held.clear()
    assert not held


def test_the_protocol_documents_the_refusal_as_the_gateway_answers_it() -> None:
    """PROTOCOL.md's RejectReason row: over_budget is step 13a and answered with an Ack (what the test above
    sees); the check-order table names it at that step."""
    from tests.test_protocol_conformance import answered_with_ack, code, doc_table, reject_rows

    row = reject_rows()["OVER_BUDGET"]
    assert code(row["label"]) == "over_budget" and "step 13a" in row["raised when"]
    assert answered_with_ack("over_budget")
    steps = {row["step"]: code(row["reject reason"]) for row in doc_table("## 7. Receiver check order")}
    assert steps["13a"] == "OVER_BUDGET"


async def test_during_a_full_rate_bomb_flood_another_agent_is_served(models_dir: Path) -> None:
    """An attacker firing 300 bombs of 32 MiB as fast as it can, on one carrier, while a victim sends 20
    frames of 5 on another: the defaults decompress one (a full bucket; each costs a GiB), the other 299
    are refused, and each of the victim's 100 requests is answered OK. (Without the budget the gateway
    decompresses all 300, 9.4 GiB; bench/budget_attack.py measures what that does to the victim.)"""
    flood = [bomb(32 * MIB, "attacker") for _ in range(300)]
    victims = synthetic(100, seed=90)
    asked = [victims[i : i + 5] for i in range(0, 100, 5)]
    async with (
        run_gateway(models_dir=models_dir) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="attacker") as attacker,
        WireClient(gw.endpoint("pccw"), agent_id="victim") as victim,
    ):

        async def attack() -> None:
            for f in flood:
                await attacker.send_raw(f)

        async def serve_victim() -> list[pb.InferResponse]:
            answers: list[pb.InferResponse] = []
            for batch in asked:
                answers += await victim.infer(batch)
            return answers

        _, answers = await asyncio.gather(attack(), serve_victim())
        await wait_for(lambda: rejected(gw, "hgc", "payload_invalid") >= 1, what="the bomb refused")
        await wait_for(lambda: rejected(gw, "hgc", "over_budget") >= 299, what="the flood refused")
        await attacker.ping()  # after every refusal: their Acks came first
        assert rejected(gw, "hgc", "payload_invalid") == 1
        assert rejected(gw, "hgc", "over_budget") == 299
        assert rejected(gw, "pccw", "over_budget") == 0
        # Told to wait TOLD_PER_HOLD times; the rest of the flood is counted and dropped unanswered.
        told = [a for a in attacker.acks.values() if a.frame_reject == pb.REJECT_REASON_OVER_BUDGET]
        assert len(told) == TOLD_PER_HOLD
    assert [r.request_id for r in answers] == [r.request_id for r in victims]
    assert all(r.status == pb.STATUS_OK for r in answers)


async def test_only_the_decode_is_charged_not_the_serving_that_follows(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lone realtime requests are served inside the frame's handling (the fast path): a frame whose
    requests cost the loop 30 ms each after the decode must not run its agent into decode debt. With the
    serving charged too (as it once was), the 0.05 s budget below refuses this agent from its third frame
    on; charged the decode alone, all 10 frames are taken."""
    async with run_gateway(
        models_dir=models_dir, budget={"decode_s_per_s": 0.001, "burst_decode_s": 0.05}
    ) as gw:
        take = gw.ingest._take_batch

        def costly(*args: Any) -> None:
            take(*args)
            spin = time.thread_time() + 0.03
            while time.thread_time() < spin:
                pass

        monkeypatch.setattr(gw.ingest, "_take_batch", costly)
        async with WireClient(gw.endpoint("hgc"), agent_id="busy") as agent:
            for request in synthetic(10, seed=91):
                request.priority = pb.PRIORITY_CLASS_REALTIME
                ack = await agent.wait_ack(await agent.send([request]))
                assert ack.frame_reject == pb.REJECT_REASON_UNSPECIFIED, ack.frame_reject_detail
                assert list(ack.accepted_ids) == [request.request_id]
        assert rejected(gw, "hgc", "over_budget") == 0
