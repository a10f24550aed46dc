"""Realtime answers leave as their batch is answered; other answers at the end of the loop's tick.

A tick's replies are sent by one callback queued behind everything queued before it: under a batched load,
the ingest backlog's next turn and the batchers' passes, which realtime answers waited 1-3 ms for
(bench/realtime_under_load.py). What is tested is the order on the loop: the backend queues a marker
callback as it answers, and the carrier notes when the answer is sent, before or after that marker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from zmq import Frame

from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, pb
from gateway.server import Gateway
from gateway.testing import (
    FaultInjectingBackend,
    WireClient,
    fault_injecting_pools,
    fresh_requests,
    run_gateway,
)
from inference.backends.base import InferCall, InferResult


class LoopOrder:
    """Events in the order the loop ran them: the backend's answers (each queues a marker callback as it
    returns) and the answer frames the carriers sent."""

    def __init__(self, gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.sent = asyncio.Event()
        self._codec = FrameCodec()
        for backend in gw.backends.values():
            assert isinstance(backend, FaultInjectingBackend)
            monkeypatch.setattr(backend, "infer", self._marking(backend.infer))
        for carrier in gw.carriers.values():
            monkeypatch.setattr(carrier, "send", self._noting(carrier.send))

    def _marking(self, infer: Any) -> Any:
        async def marked(call: InferCall) -> InferResult:
            result: InferResult = await infer(call)
            self.events.append("answered")
            asyncio.get_running_loop().call_soon(self.events.append, "next callback")
            return result

        return marked

    def _noting(self, send: Any) -> Any:
        def noted(routing_id: bytes, frames: list[bytes | Frame]) -> str:
            decoded = self._codec.decode([f.bytes if isinstance(f, Frame) else f for f in frames])
            if isinstance(decoded.payload, pb.ResponseBatch) and decoded.payload.responses:
                self.events.append("answer sent")
                self.sent.set()
            result: str = send(routing_id, frames)
            return result

        return noted


def requests_of(priority: pb.PriorityClass.ValueType, *models: str) -> list[pb.InferRequest]:
    """One request of each model (synthetic, fresh), of class ``priority``."""
    synthetic = [g.request for g in SyntheticTraffic(5).take(200)]
    out = fresh_requests([next(r for r in synthetic if r.model_name == m) for m in models], budget_s=30.0)
    for request in out:
        request.priority = priority
    return out


async def answered_in_order(
    models_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    requests: list[pb.InferRequest],
    frame: pb.PriorityClass.ValueType,
    events: int = 3,
) -> tuple[list[str], dict[str, int]]:
    """The order of the first ``events`` of the answers, their markers and their sending on the loop, and
    the frames the agent got, for ``requests`` sent in one frame marked ``frame``; the CPU pool batches at
    once (no wait for company)."""
    overrides = fault_injecting_pools({"type": "null"})
    overrides["pools"]["cpu"]["max_queue_delay_us"] = 0
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        order = LoopOrder(gw, monkeypatch)
        await agent.send(requests, priority=frame)
        responses = await agent.wait_responses([r.request_id for r in requests])
        assert {r.status for r in responses} == {pb.STATUS_OK}
        await asyncio.wait_for(order.sent.wait(), 10)
        return order.events[:events], dict(agent.frames_received)


async def test_realtime_answer_is_sent_before_the_next_callback(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame marked realtime: its answers go out before anything queued on the loop after them."""
    requests = requests_of(pb.PRIORITY_CLASS_REALTIME, "rank-mlp")
    events, _ = await answered_in_order(models_dir, monkeypatch, requests, pb.PRIORITY_CLASS_REALTIME)
    assert events == ["answered", "answer sent", "next callback"]


async def test_the_batches_of_one_pass_are_answered_in_one_frame(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two models, so two batches, cut in one pass of their pool: their answers leave together as the
    pass ends (one frame), not a frame per batch."""
    requests = requests_of(pb.PRIORITY_CLASS_REALTIME, "rank-mlp", "text-encoder")
    events, frames = await answered_in_order(models_dir, monkeypatch, requests, pb.PRIORITY_CLASS_REALTIME)
    assert events == ["answered", "answered", "answer sent"]
    assert frames == {"ack": 1, "responses": 1}


async def test_realtime_answers_leave_before_the_pass_goes_on_to_other_batches(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass cuts realtime batches first; their answers leave before it serves its interactive ones."""
    requests = requests_of(pb.PRIORITY_CLASS_REALTIME, "rank-mlp") + requests_of(
        pb.PRIORITY_CLASS_INTERACTIVE, "text-encoder"
    )
    events, frames = await answered_in_order(
        models_dir, monkeypatch, requests, pb.PRIORITY_CLASS_REALTIME, events=6
    )
    # The interactive answer goes with the tick's flush, queued after it was made (the one queued with the
    # realtime answer was let go when that was sent).
    assert events == ["answered", "answer sent", "answered", "next callback", "next callback", "answer sent"]
    assert frames == {"ack": 1, "responses": 2}


@pytest.mark.parametrize(
    ("request_class", "frame_class"),
    [
        (pb.PRIORITY_CLASS_INTERACTIVE, pb.PRIORITY_CLASS_INTERACTIVE),
        (pb.PRIORITY_CLASS_REALTIME, pb.PRIORITY_CLASS_INTERACTIVE),  # waited in the backlog as its frame did
    ],
)
async def test_other_answers_wait_for_the_end_of_the_tick(
    models_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    request_class: pb.PriorityClass.ValueType,
    frame_class: pb.PriorityClass.ValueType,
) -> None:
    """Answers to frames not marked realtime are coalesced per tick (one frame per agent and carrier), the
    realtime requests in such frames too."""
    requests = requests_of(request_class, "rank-mlp")
    events, _ = await answered_in_order(models_dir, monkeypatch, requests, frame_class)
    assert events == ["answered", "next callback", "answer sent"]
