"""10k hostile frames of every malformed kind: the gateway stays up and counts each one by reason."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import zstandard as zstd

from edgewire import DictionaryStore, FrameCodec, pb
from edgewire.dictionaries import train
from gateway.testing import WireClient, run_gateway, wait_for
from tests.edgewire.test_malformed import declare_content_size, zero_stream
from tests.gateway.daemon.test_serving import synthetic

LIMITS = {
    "max_frame_bytes": 65536,
    "max_decompressed_bytes": 262144,
    "max_records": 64,
    "max_header_bytes": 512,
}


def hostile_kinds() -> dict[str, Callable[[], list[bytes]]]:
    """One factory per reject reason, each producing a fresh malformed message."""
    codec = FrameCodec(min_saving=0.0)  # compressed whenever that is smaller: the frames test zstd paths
    good = synthetic(3, seed=31)

    def frames(**changes: object) -> list[bytes]:
        header, body = codec.encode(pb.RequestBatch(requests=good))
        env = pb.Envelope.FromString(header)
        for key, value in changes.items():
            setattr(env, key, value)
        return [env.SerializeToString(), body]

    other_dict = DictionaryStore.from_raw(
        [train([r.SerializeToString() * 3 for r in synthetic(40, seed=32)], 4096)]
    )
    bomb = declare_content_size(zero_stream(64 << 20), 1000)
    big = [codec.encode(pb.RequestBatch(requests=synthetic(1)), compress=False)[0], b"\0" * 70000]
    many = synthetic(70, seed=33, kind=pb.REQUEST_KIND_TEXT)

    def too_many() -> list[bytes]:
        return codec.encode(pb.RequestBatch(requests=many))

    def count_mismatch() -> list[bytes]:
        header, body = codec.encode(pb.RequestBatch(requests=good))
        env = pb.Envelope.FromString(header)
        env.record_count = 2
        return [env.SerializeToString(), body]

    def bomb_frame() -> list[bytes]:
        header = frames(uncompressed_length=1000)[0]
        return [header, bomb]

    return {
        "wrong_frame_count": lambda: [b"only-one"],
        "header_too_large": lambda: [b"\x0a" + b"x" * 600, b""],
        "header_invalid": lambda: [b"\x12\x10" + b"truncated", b""],  # message_id claims 16 bytes, has 9
        "unsupported_version": lambda: frames(schema_version=9),
        "bad_message_id": lambda: frames(message_id=b"\0" * 16),
        "unknown_kind": lambda: frames(kind=77),
        "unknown_codec": lambda: frames(codec=9),
        "unknown_dictionary": lambda: FrameCodec(dictionaries=other_dict, min_saving=0.0).encode(
            pb.RequestBatch(requests=good)
        ),
        "frame_too_large": lambda: big,
        "declared_too_large": lambda: frames(uncompressed_length=1 << 30),
        "decompression_failed": bomb_frame,
        "length_mismatch": lambda: frames(uncompressed_length=frames()[0] and 123),
        "payload_invalid": lambda: [
            frames(codec=pb.CODEC_NONE, uncompressed_length=5)[0],
            b"\x0a\xff\xff\xff\xff",
        ],
        "too_many_records": too_many,
        "record_count_mismatch": count_mismatch,
        "unexpected_kind": lambda: codec.encode(pb.Pong(nonce=1)),
    }


async def test_ten_thousand_hostile_frames_are_counted_and_survived(models_dir: Path) -> None:
    """Every malformed frame is refused and counted under its reason; afterwards the gateway still serves."""
    kinds = hostile_kinds()
    rng = random.Random(5)
    plan = [rng.choice(sorted(kinds)) for _ in range(10_000)]
    sent = Counter(plan)
    async with run_gateway(models_dir=models_dir, limits=LIMITS) as gw:
        async with WireClient(gw.endpoint("hgc"), agent_id="hostile") as attacker:
            for reason in plan:
                await attacker.send_raw(kinds[reason]())

            def counted() -> Counter[str]:
                return Counter(
                    {
                        reason: int(
                            gw.metrics.registry.get_sample_value(
                                "hkgw_frames_rejected_total", {"carrier": "hgc", "reason": reason}
                            )
                            or 0
                        )
                        for reason in kinds
                    }
                )

            await wait_for(lambda: sum(counted().values()) >= 10_000, timeout_s=60)
        assert counted() == sent
        async with WireClient(gw.endpoint("pccw")) as agent:
            responses = await agent.infer(synthetic(10, seed=34, kind=pb.REQUEST_KIND_TEXT))
            assert (await agent.ping()).nonce == 7
    assert all(r.status == pb.STATUS_OK for r in responses)
    assert len(sent) == 16
    assert zstd.frame_content_size(kinds["decompression_failed"]()[1]) == 1000
