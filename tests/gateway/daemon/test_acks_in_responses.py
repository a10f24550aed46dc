"""An agent that reads Acks in a ResponseBatch (FEATURE_ACKS_IN_RESPONSES) gets one reply frame for a lone
realtime request served at once; every other agent gets its Acks as frames of their own, as before."""

from __future__ import annotations

from pathlib import Path

from edge_agent.synthetic import SyntheticTraffic
from edgewire import new_id, pb
from gateway.testing import WireClient, fresh_requests, run_gateway

ACKS = pb.FEATURE_ACKS_IN_RESPONSES
HOLD = {"replies": {"ack_hold_us": 100_000}}  # the embedded ONNX models answer within it, on a busy machine


def realtime(n: int, seed: int = 3) -> list[pb.InferRequest]:
    out = fresh_requests([r.request for r in SyntheticTraffic(seed).take(n)])
    for request in out:
        request.priority = pb.PRIORITY_CLASS_REALTIME
    return out


async def one_by_one(agent: WireClient, requests: list[pb.InferRequest]) -> list[bytes]:
    """Send each request as a frame of its own and wait for its answer and its frame's Ack."""
    sent = []
    for request in requests:
        message_id = await agent.send([request], priority=pb.PRIORITY_CLASS_REALTIME)
        await agent.wait_responses([request.request_id])
        await agent.wait_ack(message_id)
        sent.append(message_id)
    return sent


async def test_lone_realtime_request_gets_one_reply_frame(models_dir: Path) -> None:
    """Each lone realtime request is acknowledged and answered in one ResponseBatch, nothing else."""
    requests = realtime(12)
    async with (
        run_gateway(models_dir=models_dir, **HOLD) as gw,
        WireClient(gw.endpoint("hgc"), features=ACKS) as agent,
    ):
        sent = await one_by_one(agent, requests)
        frames = dict(agent.frames_received)
    assert frames == {"responses+acks": len(requests)}
    for message_id, request in zip(sent, requests, strict=True):
        assert list(agent.acks[message_id].accepted_ids) == [request.request_id]
        assert agent.responses[request.request_id].status == pb.STATUS_OK


async def test_agent_without_the_feature_gets_acks_on_their_own(models_dir: Path) -> None:
    """Envelope.features 0 (an agent from before the feature): an Ack frame, then the answer frame."""
    requests = realtime(6)
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        await one_by_one(agent, requests)
        frames = dict(agent.frames_received)
    assert frames == {"ack": len(requests), "responses": len(requests)}


async def test_frame_with_nothing_to_answer_gets_its_ack_alone(models_dir: Path) -> None:
    """A frame whose requests are all refused (unknown model) is acknowledged at once, alone: its Ack is
    not held, so it does not ride with the answer of the frame sent right after it."""
    refused, served = realtime(2)
    refused.model_name = "no-such-model"
    async with (
        run_gateway(models_dir=models_dir, **HOLD) as gw,
        WireClient(gw.endpoint("hgc"), features=ACKS) as agent,
    ):
        first = await agent.send([refused], priority=pb.PRIORITY_CLASS_REALTIME)
        second = await agent.send([served], priority=pb.PRIORITY_CLASS_REALTIME)
        await agent.wait_responses([served.request_id])
        ack = await agent.wait_ack(first)
        await agent.wait_ack(second)
        frames = dict(agent.frames_received)
    assert [n.reason for n in ack.nacks] == [pb.NACK_REASON_UNKNOWN_MODEL]
    assert frames == {"ack": 1, "responses+acks": 1}  # the held one is the second frame's alone


async def test_resend_of_an_answered_request_rides_with_its_cached_answer(models_dir: Path) -> None:
    """A resend of an answered request (a new frame) gets the duplicate Ack and the cached answer in one
    frame, on the carrier it came on, and the request is not run again."""
    request = realtime(1)[0]
    async with run_gateway(models_dir=models_dir, **HOLD) as gw:
        async with WireClient(gw.endpoint("hgc"), features=ACKS) as first:
            await one_by_one(first, [request])
            answer = first.responses[request.request_id]
        async with WireClient(gw.endpoint("pccw"), features=ACKS) as again:
            message_id = await again.send([request], message_id=new_id(), priority=pb.PRIORITY_CLASS_REALTIME)
            await again.wait_responses([request.request_id])
            ack = await again.wait_ack(message_id)
            frames = dict(again.frames_received)
    assert list(ack.duplicate_ids) == [request.request_id]
    assert frames == {"responses+acks": 1}
    assert again.responses[request.request_id] == answer


async def test_burst_of_frames_is_acknowledged_with_fewer_frames_than_acks(models_dir: Path) -> None:
    """Frames read in one wake-up share reply frames: every frame's Ack arrives, and every answer, in
    fewer frames than an Ack and an answer frame apiece."""
    requests = realtime(40, seed=5)
    async with (
        run_gateway(models_dir=models_dir, **HOLD) as gw,
        WireClient(gw.endpoint("tgt"), features=ACKS) as agent,
    ):
        sent = [await agent.send([r], priority=pb.PRIORITY_CLASS_REALTIME) for r in requests]
        responses = await agent.wait_responses([r.request_id for r in requests])
        for message_id in sent:
            await agent.wait_ack(message_id)
        frames = sum(agent.frames_received.values())
    assert all(r.status == pb.STATUS_OK for r in responses)
    assert frames < 2 * len(requests)
    assert agent.duplicate_responses == 0


async def test_ack_whose_answers_take_longer_than_the_hold_goes_alone(models_dir: Path) -> None:
    """With no hold (ack_hold_us = 0) the Ack leaves at the end of the tick that read the frame; the
    embedded models answer from a thread, in a later tick, so each answer comes in a frame of its own."""
    requests = realtime(6)
    no_hold = {"replies": {"ack_hold_us": 0}}
    async with (
        run_gateway(models_dir=models_dir, **no_hold) as gw,
        WireClient(gw.endpoint("hgc"), features=ACKS) as agent,
    ):
        await one_by_one(agent, requests)
        frames = dict(agent.frames_received)
    assert frames == {"ack": len(requests), "responses": len(requests)}
