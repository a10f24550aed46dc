"""Which refused frames get an Ack (PROTOCOL.md section 7): steps 1-3 never do, whatever frame 0 holds."""

from __future__ import annotations

from pathlib import Path

from edgewire import FrameCodec, labels, pb
from gateway.server import Gateway
from gateway.testing import WireClient, run_gateway
from tests.gateway.daemon.test_serving import synthetic


def rejected(gw: Gateway, label: str) -> float:
    labels_ = {"carrier": "hgc", "reason": label}
    return gw.metrics.registry.get_sample_value("hkgw_frames_rejected_total", labels_) or 0.0


async def test_frames_refused_before_the_envelope_get_no_ack_even_if_frame_0_parses(models_dir: Path) -> None:
    """A valid REQUEST_BATCH envelope sent with a third frame (wrong_frame_count) or grown past
    max_header_bytes (header_too_large) is counted and answered with nothing; the same envelope refused
    later (unsupported_version, step 4) gets its Ack."""
    codec = FrameCodec()
    header, body = codec.encode(pb.RequestBatch(requests=synthetic(1, seed=71)))
    oversized = pb.Envelope.FromString(header)
    oversized.region = "r" * 2000
    assert len(oversized.SerializeToString()) > 1024
    cases = {
        "wrong_frame_count": [header, body, b"a frame too many"],
        "header_too_large": [oversized.SerializeToString(), body],
    }
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        for label, frames in cases.items():
            await agent.send_raw(frames)
            await agent.ping()  # replies to one connection keep their order: an Ack would come first
            assert rejected(gw, label) == 1, label
            assert agent.acks == {}, (label, agent.acks)
        later = pb.Envelope.FromString(header)
        later.schema_version = 9
        await agent.send_raw([later.SerializeToString(), body])
        await agent.ping()
        assert list(agent.acks) == [later.message_id]
        assert labels.REJECT[agent.acks[later.message_id].frame_reject] == "unsupported_version"
