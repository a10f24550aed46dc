"""Large zstd payloads inflated on a thread, not the event loop (gateway/ingress/inflate.py): the
inflater on its own, and a real gateway serving such frames, other agents meanwhile, and drain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zstandard as zstd

from edgewire import FrameCodec, FrameError, new_id, now_unix_us, pb
from edgewire.codec import Buffer
from edgewire.limits import CodecLimits
from gateway.ingress.inflate import OffLoopInflater
from gateway.server import Gateway
from gateway.testing import WireClient, run_gateway, wait_for
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


async def test_another_agent_is_served_while_a_bomb_inflates(models_dir: Path) -> None:
    """A 128 MiB bomb takes libzstd tens of milliseconds. Received, it holds no one up: a lone request sent
    by another agent once the bomb is in is answered before the bomb is refused (on the loop, the bomb's
    whole decode ran before the next frame was read), and the bomb is still refused payload_invalid."""
    frames = bomb(128 * MIB)
    victim_request = synthetic(1, seed=95)
    async with (
        run_gateway(models_dir=models_dir, limits={"max_decompressed_bytes": 256 * MIB}) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="attacker") as attacker,
        WireClient(gw.endpoint("pccw"), agent_id="victim") as victim,
    ):
        await attacker.send_raw(frames)
        await wait_for(
            lambda: counted(gw, "hkgw_frames_received_total", carrier="hgc", kind="request_batch") == 1,
            what="the bomb received",
        )
        answers = await victim.infer(victim_request)
        assert counted(gw, "hkgw_frames_rejected_total", carrier="hgc", reason="payload_invalid") == 0
        await wait_for(
            lambda: counted(gw, "hkgw_frames_rejected_total", carrier="hgc", reason="payload_invalid") == 1,
            what="the bomb refused",
        )
        ack = await attacker.wait_ack(pb.Envelope.FromString(frames[0]).message_id)
    assert [a.status for a in answers] == [pb.STATUS_OK]
    assert ack.frame_reject == pb.REJECT_REASON_PAYLOAD_INVALID


@pytest.mark.parametrize("budget_enabled", [True, False])
async def test_drain_waits_for_a_frame_being_inflated_and_answers_it(
    models_dir: Path, budget_enabled: bool
) -> None:
    """A large batch still inflating when the drain begins is taken before the drain ends: its request is
    answered (nacked DRAINING, retryable) and nothing is left on the thread. Its agent's bytes were charged
    (when it was admitted)."""
    request = synthetic(1, seed=96)[0]
    # One request carrying 96 MiB of zeros in a parameter: compressible to almost nothing, a valid batch.
    request.parameters["padding"] = "0" * (96 * MIB)
    codec = FrameCodec(CodecLimits(max_decompressed_bytes=256 * MIB))
    async with (
        run_gateway(
            models_dir=models_dir,
            drain_grace_s=0.0,
            limits={"max_decompressed_bytes": 256 * MIB},
            budget={"enabled": budget_enabled},
        ) as gw,
        WireClient(gw.endpoint("tgt"), agent_id="big") as agent,
    ):
        header, body = codec.encode(pb.RequestBatch(requests=[request]), agent_id="big", region="us-west")
        await agent.send_raw([header, body])
        await wait_for(lambda: gw.ingest is not None and gw.ingest.inflater.pending == 1, what="inflating")
        assert gw.ingest is not None
        await gw.drain()
        assert gw.ingest.inflater.pending == 0
        ack = await agent.wait_ack(pb.Envelope.FromString(header).message_id)
        balance = gw.ingest.budgets.balance("big")
    assert [n.reason for n in ack.nacks] == [pb.NACK_REASON_DRAINING]
    assert [n.request_id for n in ack.nacks] == [request.request_id]
    if budget_enabled:
        assert balance is not None
        bytes_left, _ = balance
        assert bytes_left < 0  # 96 MiB costs 96 x 96 MiB (large_frame_bytes): a full bucket and more
    else:
        assert balance is None
