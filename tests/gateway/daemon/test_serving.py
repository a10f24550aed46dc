"""A DEALER client built from the shared codec gets correct responses, on every carrier."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, new_id, now_unix_us, pb
from gateway.testing import WireClient, fresh_requests, run_gateway


def synthetic(n: int, seed: int = 1, kind: int | None = None) -> list[pb.InferRequest]:
    out = [
        r.request
        for r in SyntheticTraffic(seed).take(n * 4 if kind else n)
        if kind is None or r.request.kind == kind
    ]
    return fresh_requests(out[:n])


@pytest.mark.parametrize("carrier", ["hgc", "pccw", "tgt"])
async def test_each_carrier_serves_every_request_kind(models_dir: Path, carrier: str) -> None:
    """Ranking, text and image requests all come back OK with outputs, whichever carrier carries them."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint(carrier)) as agent:
        requests = synthetic(40, seed=2)
        responses = await agent.infer(requests)
    assert {r.kind for r in requests} >= {pb.REQUEST_KIND_RANKING, pb.REQUEST_KIND_TEXT}
    assert all(r.status == pb.STATUS_OK for r in responses), [
        r.error_message for r in responses if r.status != 1
    ]
    assert all(
        r.tier in (pb.TIER_EDGE_SERVER, pb.TIER_CLOUD) and r.pool and r.route_reason for r in responses
    )
    assert agent.duplicate_responses == 0


async def test_ranking_response_is_top_k_of_the_candidates(models_dir: Path) -> None:
    """A ranking answer names top_k of the request's own candidates, scores descending."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        requests = synthetic(5, kind=pb.REQUEST_KIND_RANKING)
        responses = await agent.infer(requests)
    for request, response in zip(requests, responses, strict=True):
        outputs = {t.name: t for t in response.outputs}
        ids = np.frombuffer(outputs["item_ids"].raw_data, dtype="<u8")
        scores = np.frombuffer(outputs["scores"].raw_data, dtype="<f4")
        assert len(ids) == min(request.ranking.top_k, len(request.ranking.candidate_item_ids))
        assert set(ids.tolist()) <= set(request.ranking.candidate_item_ids)
        assert np.all(np.diff(scores) <= 0)


async def test_text_and_image_outputs(models_dir: Path) -> None:
    """Text gives a unit-length embedding; an image gives class probabilities summing to one and a label."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("pccw")) as agent:
        text = synthetic(3, kind=pb.REQUEST_KIND_TEXT)
        image = synthetic(3, seed=4, kind=pb.REQUEST_KIND_IMAGE)
        responses = await agent.infer(text + image)
    for response in responses[:3]:
        embedding = np.frombuffer({t.name: t for t in response.outputs}["embedding"].raw_data, dtype="<f4")
        assert embedding.shape == (64,)
        assert abs(float(np.linalg.norm(embedding)) - 1.0) < 1e-4
    for response in responses[3:]:
        outputs = {t.name: t for t in response.outputs}
        probs = np.frombuffer(outputs["probs"].raw_data, dtype="<f4")
        assert abs(float(probs.sum()) - 1.0) < 1e-4
        assert outputs["label"].datatype == pb.DATA_TYPE_BYTES


async def test_responses_carry_timing_and_version(models_dir: Path) -> None:
    """Every OK response reports the model version that served and the server-side timings."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("tgt")) as agent:
        responses = await agent.infer(synthetic(10, seed=5))
    for response in responses:
        assert response.model_version == "1"
        assert response.timing.total_us >= response.timing.infer_us > 0


async def test_ack_lists_every_request(models_dir: Path) -> None:
    """The ack accounts for each request of the frame exactly once."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        requests = synthetic(20, seed=6)
        message_id = await agent.send(requests)
        ack = await agent.wait_ack(message_id)
        await agent.wait_responses([r.request_id for r in requests])
    assert sorted(ack.accepted_ids) == sorted(r.request_id for r in requests)
    assert not ack.nacks
    assert not ack.duplicate_ids


async def test_unknown_model_and_expired_deadline_are_nacked(models_dir: Path) -> None:
    """Requests the gateway will not take are nacked with their reason, the others served."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        good, unknown, expired = synthetic(3, seed=7)
        unknown.model_name = "no-such-model"
        expired.deadline_unix_us = now_unix_us() - 1000
        message_id = await agent.send([good, unknown, expired])
        ack = await agent.wait_ack(message_id)
        await agent.wait_responses([good.request_id])
    reasons = {n.request_id: n.reason for n in ack.nacks}
    assert reasons == {
        unknown.request_id: pb.NACK_REASON_UNKNOWN_MODEL,
        expired.request_id: pb.NACK_REASON_DEADLINE_EXPIRED,
    }
    assert list(ack.accepted_ids) == [good.request_id]


async def test_ping_is_answered_with_limits_and_dictionaries(models_dir: Path) -> None:
    """Pong echoes the nonce and the ping's send time and states the gateway's limits."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("pccw")) as agent:
        pong = await agent.ping()
    assert pong.nonce == 7
    assert pong.limits.max_records == 1024
    assert pong.server_time_unix_us > 0
    assert not pong.draining


async def test_request_id_that_is_not_uuid7_is_nacked(models_dir: Path) -> None:
    """A request without a valid id is refused alone; the frame's other requests are served."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        good, bad = synthetic(2, seed=8)
        bad.request_id = b"\x01" * 16
        ack = await agent.wait_ack(await agent.send([good, bad]))
    assert [n.reason for n in ack.nacks] == [pb.NACK_REASON_INVALID_REQUEST]
    assert list(ack.accepted_ids) == [good.request_id]


def test_codec_client_and_gateway_agree_on_ids() -> None:
    """The shared codec makes the ids the gateway checks."""
    frames = FrameCodec().encode(pb.RequestBatch(requests=[pb.InferRequest(request_id=new_id())]))
    assert len(frames) == 2
    assert Counter(type(f) for f in frames) == Counter({bytes: 2})


async def test_ids_the_dedupe_bound_drops_early_are_counted(models_dir: Path) -> None:
    """Past dedupe.max_entries the oldest ids leave the window before their time, and the gateway says
    how many (hkgw_dedupe_evicted_early_total): those could be served twice if resent."""
    async with (
        run_gateway(models_dir=models_dir, dedupe={"max_entries": 1000}) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        for seed in range(11):
            responses = await agent.infer(synthetic(100, seed=90 + seed))
            assert len(responses) == 100
        evicted = gw.metrics.registry.get_sample_value("hkgw_dedupe_evicted_early_total")
        entries = gw.metrics.registry.get_sample_value("hkgw_dedupe_entries")
    assert evicted == 100
    assert entries == 1000
