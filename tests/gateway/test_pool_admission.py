"""A pool's full queue shared between agents (gateway/dispatch/admission.py), as PoolDispatcher.submit_many
applies it: on a pool that is not started (nothing is served, so what is queued stays), the real null
backend, breaker, CPU stage object (no worker started) and metrics."""

from __future__ import annotations

import time

from edgewire import pb
from gateway.backends.null import NullBackend
from gateway.config import PoolDispatch
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.cpu import CpuStage
from gateway.dispatch.pool import PoolDispatcher
from gateway.dispatch.work import WorkItem
from gateway.ops.metrics import GatewayMetrics
from routing.types import Decision, Priority, Reason, Tier

DECISION = Decision(Tier.EDGE_SERVER, "cpu", Reason.COMPLEXITY, 0.4)


class Answers:
    def __init__(self) -> None:
        self.by_id: dict[bytes, pb.InferResponse] = {}

    def __call__(self, item: WorkItem, response: pb.InferResponse, outputs: bytes = b"") -> None:
        assert item.request.request_id not in self.by_id, "answered twice"
        self.by_id[item.request.request_id] = response


def pool(capacity: int, answers: Answers) -> PoolDispatcher:
    metrics = GatewayMetrics(["rank-mlp"])
    return PoolDispatcher(
        "cpu",
        PoolDispatch(backend="embedded"),
        NullBackend("embedded"),
        CircuitBreaker(3, 1.0, 1),
        max_queue_depth=capacity,
        concurrency=2,
        metrics=metrics,
        cpu=CpuStage(0, "thread", metrics),
        respond=answers,
        respond_ok=lambda *args: None,
        reroute=lambda item, pool: False,
    )


def requests(agent: str, n: int, priority: Priority, deadline: float | None = None) -> list[WorkItem]:
    return [
        WorkItem(
            pb.InferRequest(request_id=f"{agent}-{priority.value}-{i}".encode(), model_name="rank-mlp"),
            agent,
            "us-west",
            "hgc",
            priority,
            0.0,
            deadline,
            DECISION,
        )
        for i in range(n)
    ]


def test_a_request_pushes_out_only_requests_no_more_urgent_than_its_own() -> None:
    """a's 16 realtime requests fill the queue: b's batch requests may not push them out (refused, nothing
    answered); b's realtime ones may, up to b's share, and a's newest realtime ones are answered
    OVERLOADED."""
    answers = Answers()
    p = pool(16, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 16, Priority.REALTIME), now)
    assert not p.pushes_out_for("a")  # alone: no share to claim
    assert p.pushes_out_for("b") and p.signals_for("b", now).queue_depth == 8  # room for b's share
    assert not p.submit_many(requests("b", 4, Priority.BATCH), now)
    assert (p.depth, answers.by_id) == (16, {})
    assert p.submit_many(requests("b", 4, Priority.REALTIME), now)
    assert p.depth == 16
    assert sorted(answers.by_id) == [f"a-realtime-{i}".encode() for i in range(12, 16)]  # the newest
    assert {r.status for r in answers.by_id.values()} == {pb.STATUS_OVERLOADED}
    assert not p.submit_many(requests("b", 5, Priority.REALTIME), now)  # past b's share of 8


def test_a_pushed_out_request_whose_deadline_passed_is_answered_deadline_exceeded() -> None:
    """Pushed out with its deadline gone, a request is answered DEADLINE_EXCEEDED (not resent in vain);
    the batch lane goes first, then the newest of the interactive one."""
    answers = Answers()
    p = pool(8, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 6, Priority.INTERACTIVE), now)
    # queued with their deadline already gone (the queue checks deadlines at the cut, not on entry)
    assert p.submit_many(requests("a", 2, Priority.BATCH, deadline=now - 1.0), now)
    assert p.submit_many(requests("b", 3, Priority.INTERACTIVE), now)
    statuses = {rid.decode(): r.status for rid, r in answers.by_id.items()}
    assert statuses == {
        "a-batch-0": pb.STATUS_DEADLINE_EXCEEDED,
        "a-batch-1": pb.STATUS_DEADLINE_EXCEEDED,
        "a-interactive-5": pb.STATUS_OVERLOADED,
    }
    assert p.depth == 8


def test_a_reload_resizes_the_queue_routing_reads() -> None:
    answers = Answers()
    p = pool(16, answers)
    p.resize(4, 3)
    assert (p.max_queue_depth, p.concurrency) == (4, 3)
    assert not p.submit_many(requests("a", 5, Priority.BATCH), time.monotonic())
