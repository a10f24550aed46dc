"""Large zstd payloads inflated on a thread, not the event loop (gateway/ingress/inflate.py): the
inflater on its own, and a real gateway serving such frames, other agents meanwhile, and drain."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import zstandard as zstd

from edgewire import FrameCodec, FrameError, labels, new_id, now_unix_us, pb
from edgewire.codec import Buffer
from gateway.ingress.inflate import OffLoopInflater
from gateway.server import Gateway
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic

MIB = 1 << 20


def envelope_of(body: bytes, declared: int, codec: int = pb.CODEC_ZSTD) -> pb.Envelope:
    return pb.Envelope(
        schema_version=1,
        message_id=new_id(),
        agent_id="attacker",
        region="us-west",
        kind=pb.MESSAGE_KIND_REQUEST_BATCH,
        codec=codec,
        uncompressed_length=declared,
        sent_at_unix_us=now_unix_us(),
    )


def zeros(n: int) -> bytes:
    return zstd.ZstdCompressor(level=3, write_content_size=True).compress(bytes(n))


def bomb(declared: int) -> list[bytes]:
    """~1 KB of zstd honestly declaring ``declared`` bytes of zeros (they do not parse: payload_invalid)."""
    body = zeros(declared)
    return [envelope_of(body, declared).SerializeToString(), body]


def counted(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------------------------- the inflater


async def test_the_inflater_takes_large_zstd_frames_while_it_has_room_and_hands_back_bytes_or_a_refusal() -> (
    None
):
    """Only zstd payloads of at least ``min_bytes`` go to the thread, at most ``max_pending`` at once; each
    comes back on the loop with its bytes (or the codec's refusal, with its reason) and the thread's CPU."""
    inflater = OffLoopInflater(FrameCodec(), min_bytes=MIB, max_pending=1)
    big, small = zeros(4 * MIB), zeros(1024)
    assert not inflater.takes(envelope_of(small, 1024))
    assert not inflater.takes(envelope_of(b"\0" * (2 * MIB), 2 * MIB, codec=pb.CODEC_NONE))
    loop = asyncio.get_running_loop()
    results: list[tuple[Buffer | FrameError, float]] = []
    back: asyncio.Future[None] = loop.create_future()

    def done(raw: Buffer | FrameError, cpu_s: float) -> None:
        results.append((raw, cpu_s))
        if len(results) == 2:
            back.set_result(None)

    try:
        assert inflater.takes(envelope_of(big, 4 * MIB))
        inflater.submit(envelope_of(big, 4 * MIB), big, done)
        assert inflater.pending == 1
        assert not inflater.takes(envelope_of(big, 4 * MIB))  # full: the next large one stays on the loop
        await wait_for(lambda: inflater.pending == 0, what="the first frame back")
        assert inflater.takes(envelope_of(big, 4 * MIB))
        inflater.submit(envelope_of(big, 5 * MIB), big, done)  # declares more than the zstd frame holds
        await asyncio.wait_for(back, 10)
    finally:
        inflater.close()
    (raw, cpu_s), (refused, _) = results
    assert isinstance(raw, bytes) and raw == bytes(4 * MIB) and cpu_s > 0
    assert isinstance(refused, FrameError) and refused.reason == pb.REJECT_REASON_LENGTH_MISMATCH
    assert inflater.inflated == 2 and await inflater.settle(0.1)


async def test_settle_waits_for_the_frames_out_when_called_not_for_later_ones(gate: threading.Event) -> None:
    """Drain's wait: the frames submitted before settle() are waited for, a frame submitted after it is not
    (a stream of them cannot hold a drain up), and a settle that runs out of time says so."""
    inflater = OffLoopInflater(FrameCodec(), min_bytes=MIB, max_pending=4)
    big = zeros(2 * MIB)
    back: list[float] = []

    def done(raw: Buffer | FrameError, cpu_s: float) -> None:
        back.append(cpu_s)

    try:
        inflater.submit(envelope_of(big, 2 * MIB), big, done)
        assert not await inflater.settle(0.05)  # the gate holds it
        settling = asyncio.create_task(inflater.settle(10))
        await asyncio.sleep(0)
        inflater.submit(envelope_of(big, 2 * MIB), big, done)  # after settle() was called
        gate.set()
        assert await settling
        assert len(back) >= 1
        await wait_for(lambda: inflater.pending == 0, what="the later frame back")
    finally:
        inflater.close()
    assert len(back) == 2


async def test_close_takes_no_more_frames_and_drops_what_waits(gate: threading.Event) -> None:
    """After close() no frame goes to the thread; frames that waited for it are dropped, not counted as out
    (hkgw_inflate_pending back to what is really in the thread)."""
    inflater = OffLoopInflater(FrameCodec(), min_bytes=MIB, max_pending=4)
    big = zeros(2 * MIB)
    handed: list[object] = []
    for _ in range(3):
        inflater.submit(envelope_of(big, 2 * MIB), big, lambda raw, cpu_s: handed.append(raw))
    await wait_for(lambda: inflater.pending == 3, what="three out")
    inflater.close()
    assert not inflater.takes(envelope_of(big, 2 * MIB))
    assert inflater.pending <= 1  # the one in the thread, if it had started; the two waiting are dropped
    gate.set()
    await wait_for(lambda: inflater.pending == 0, what="the one in the thread back")
    assert len(handed) <= 1


# ------------------------------------------------------------------------------------ in a gateway


async def test_a_large_batch_is_inflated_off_the_loop_and_served_as_any_other(models_dir: Path) -> None:
    """A compressed batch over ``inflate_off_loop_bytes`` is accepted and answered OK request by request,
    counted as inflated off the loop; a small one is not."""
    requests = synthetic(40, seed=93)
    async with (
        run_gateway(models_dir=models_dir, limits={"inflate_off_loop_bytes": 4096}) as gw,
        WireClient(gw.endpoint("pccw")) as agent,
    ):
        header, _ = agent.codec.encode(pb.RequestBatch(requests=requests))
        envelope = pb.Envelope.FromString(header)
        assert envelope.codec == pb.CODEC_ZSTD and envelope.uncompressed_length > 4096
        answers = await agent.infer(requests)
        assert counted(gw, "hkgw_frames_inflated_off_loop_total", carrier="pccw") == 1
        await agent.infer(synthetic(1, seed=94))  # a frame under the threshold stays on the loop
        assert counted(gw, "hkgw_frames_inflated_off_loop_total", carrier="pccw") == 1
        assert counted(gw, "hkgw_inflate_pending") == 0
    assert [a.request_id for a in answers] == [r.request_id for r in requests]
    assert all(a.status == pb.STATUS_OK for a in answers), [a.error_message for a in answers]


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The inflate thread waits for this before it inflates anything (at most 10 s): the tests below see
    the gateway while a frame is out, however fast this machine decompresses."""
    opened = threading.Event()
    inflate = OffLoopInflater._inflate

    def gated(
        self: OffLoopInflater, envelope: pb.Envelope, body: Buffer
    ) -> tuple[Buffer | FrameError, float]:
        opened.wait(10)
        return inflate(self, envelope, body)

    monkeypatch.setattr(OffLoopInflater, "_inflate", gated)
    return opened


def counted_reject(gw: Gateway, carrier: str, reason: str) -> float:
    return counted(gw, "hkgw_frames_rejected_total", carrier=carrier, reason=reason)


@pytest.mark.parametrize(
    "kind",
    [pb.MESSAGE_KIND_REQUEST_BATCH, pb.MESSAGE_KIND_PING, pb.MESSAGE_KIND_DICTIONARY_REQUEST],
    ids=["request_batch", "ping", "dictionary_request"],
)
async def test_another_agent_is_served_while_a_bomb_inflates(
    models_dir: Path, gate: threading.Event, kind: int
) -> None:
    """A 32 MiB bomb of any kind the gateway decodes, received, holds no one up: a lone request another
    agent sends once the bomb is in is answered while the bomb is still out (on the loop, the bomb's whole
    decode ran before the next frame was read: 20-25 ms here), and the bomb is then refused
    payload_invalid (a batch with an Ack naming it)."""
    frames = bomb(32 * MIB)
    envelope = pb.Envelope.FromString(frames[0])
    envelope.kind = kind  # type: ignore[assignment]
    frames[0] = envelope.SerializeToString()
    async with (
        run_gateway(models_dir=models_dir) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="attacker") as attacker,
        WireClient(gw.endpoint("pccw"), agent_id="victim") as victim,
    ):
        await attacker.send_raw(frames)
        await wait_for(
            lambda: (
                counted(gw, "hkgw_frames_received_total", carrier="hgc", kind=labels.MESSAGE_KIND[kind]) == 1
            ),
            what="the bomb received",
        )
        answers = await victim.infer(synthetic(1, seed=95))
        assert counted_reject(gw, "hgc", "payload_invalid") == 0
        assert counted(gw, "hkgw_inflate_pending") == 1
        gate.set()
        await wait_for(lambda: counted_reject(gw, "hgc", "payload_invalid") == 1, what="the bomb refused")
        assert counted(gw, "hkgw_frames_inflated_off_loop_total", carrier="hgc") == 1
        if kind == pb.MESSAGE_KIND_REQUEST_BATCH:
            ack = await attacker.wait_ack(envelope.message_id)
            assert ack.frame_reject == pb.REJECT_REASON_PAYLOAD_INVALID
    assert [a.status for a in answers] == [pb.STATUS_OK]


@pytest.mark.parametrize("budget_enabled", [True, False])
async def test_drain_waits_for_a_frame_being_inflated_and_answers_it(
    models_dir: Path, gate: threading.Event, budget_enabled: bool
) -> None:
    """A large batch still inflating when the drain begins is taken before the drain ends: the drain waits
    for it (its wait registered, not done while the frame is held), its request is answered (nacked
    DRAINING, retryable) and nothing is left on the thread. Its agent's bytes were charged (when it was
    admitted)."""
    request = synthetic(1, seed=96)[0]
    # One request carrying 4 MiB of zeros in a parameter: compressible to almost nothing, a valid batch.
    request.parameters["padding"] = "0" * (4 * MIB)
    codec = FrameCodec()
    async with (
        run_gateway(
            models_dir=models_dir,
            drain_grace_s=0.0,
            budget={"enabled": budget_enabled, "bytes_per_s": 1024},  # no refill to speak of
        ) as gw,
        WireClient(gw.endpoint("tgt"), agent_id="big") as agent,
    ):
        header, body = codec.encode(pb.RequestBatch(requests=[request]), agent_id="big", region="us-west")
        await agent.send_raw([header, body])
        ingest = gw.ingest
        assert ingest is not None
        await wait_for(lambda: ingest.inflater.pending == 1, what="inflating")
        drain = asyncio.create_task(gw.drain())
        # The drain reaches its wait for the frame out, and waits: it is not done while the frame is held.
        await wait_for(lambda: bool(ingest.inflater._waiters), what="the drain waiting for the frame")
        assert not drain.done() and ingest.inflater.pending == 1
        gate.set()
        await asyncio.wait_for(drain, 10)
        assert ingest.inflater.pending == 0
        ack = await agent.wait_ack(pb.Envelope.FromString(header).message_id)
        balance = ingest.budgets.balance("big")
    assert [n.reason for n in ack.nacks] == [pb.NACK_REASON_DRAINING]
    assert [n.request_id for n in ack.nacks] == [request.request_id]
    if budget_enabled:
        assert balance is not None
        # Over 4 MiB costs over 4 x 4 MiB (size x size / large_frame_bytes), charged once.
        cost = ingest.budgets.cost(pb.Envelope.FromString(header).uncompressed_length)
        assert cost > 16 * MIB
        assert balance[0] == pytest.approx(gw.config.budget.burst_bytes - cost, abs=4096)
    else:
        assert balance is None


async def test_a_failure_after_the_hand_back_is_counted_and_the_gateway_goes_on(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handling a frame back from the thread runs from the loop, not from a carrier: a bug there is counted
    in hkgw_ingest_errors_total and logged as a carrier's would be, and the next frames are served."""
    requests = synthetic(40, seed=97)
    async with (
        run_gateway(models_dir=models_dir, limits={"inflate_off_loop_bytes": 4096}) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        ingest = gw.ingest
        assert ingest is not None
        take = ingest._take_batch
        failures: list[int] = []

        def failing_once(*args: Any) -> None:
            if not failures:
                failures.append(1)
                raise RuntimeError("a bug")
            take(*args)

        monkeypatch.setattr(ingest, "_take_batch", failing_once)
        await agent.send(requests)
        await wait_for(
            lambda: counted(gw, "hkgw_ingest_errors_total", carrier="hgc") == 1, what="the failure counted"
        )
        answers = await agent.infer(fresh_requests(requests))
    assert all(a.status == pb.STATUS_OK for a in answers)
