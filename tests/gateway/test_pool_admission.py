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

    def statuses(self) -> dict[str, int]:
        return {rid.decode(): r.status for rid, r in self.by_id.items()}


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
    answered, and routing sees no room for them: it may send them to another pool); b's realtime ones
    may, up to b's share, and a's newest realtime ones are answered OVERLOADED."""
    answers = Answers()
    p = pool(16, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 16, Priority.REALTIME), now)
    assert not p.pushes_out_for("a")  # alone: no share to claim
    # b's batch requests may not push a's realtime ones out: routing sees the queue full for them
    assert not p.pushes_out_for("b") and p.signals_for("b", now).queue_depth == 16
    assert p.pushes_out_for("b", 0) and p.signals_for("b", now, 0).queue_depth == 8  # its realtime ones
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
    assert answers.statuses() == {
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


def shed(p: PoolDispatcher, reason: str) -> float:
    return p._metrics.registry.get_sample_value("hkgw_shed_total", {"pool": "cpu", "reason": reason}) or 0.0


def test_a_more_urgent_request_takes_the_place_of_the_newest_less_urgent_one_even_of_its_own_agent() -> None:
    """a's batch requests fill the queue: a is alone (at its share), yet its realtime requests are queued in
    the place of its newest batch ones, answered OVERLOADED; its batch requests are still refused."""
    answers = Answers()
    p = pool(8, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 8, Priority.BATCH), now)
    assert not p.pushes_out_for("a") and p.pushes_out_for("a", 0)
    # routing sees a realtime request as deep as the requests as urgent or more: none
    assert (p.signals(now).queue_depth, p.signals_for("a", now, 0).queue_depth) == (8, 0)
    assert not p.submit_many(requests("a", 1, Priority.BATCH), now)
    assert p.submit_many(requests("a", 2, Priority.REALTIME), now)
    assert p.depth == 8
    assert sorted(answers.by_id) == [b"a-batch-6", b"a-batch-7"]
    assert {r.status for r in answers.by_id.values()} == {pb.STATUS_OVERLOADED}
    assert all("for more urgent requests" in r.error_message for r in answers.by_id.values())
    assert (shed(p, "preempted"), shed(p, "pushed_out")) == (2, 0)
    assert p.signals_for("a", now, 0).queue_depth == 2  # the two realtime ones now lead the queue


def test_preempting_takes_the_batch_lane_first_and_answers_expired_requests_deadline_exceeded() -> None:
    """Queue of 8: a's 3 interactive, 3 batch (2 of them expired), b's 2 batch. b's 5 realtime: the
    batch lane's 5 go (a's 3 with the most first, then b's), not a's interactive ones; the expired ones
    are answered DEADLINE_EXCEEDED and counted as such."""
    answers = Answers()
    p = pool(8, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 3, Priority.INTERACTIVE), now)
    assert p.submit_many(requests("a", 1, Priority.BATCH), now)
    assert p.submit_many(requests("a", 3, Priority.BATCH, deadline=now - 1.0)[1:], now)
    assert p.submit_many(requests("b", 2, Priority.BATCH), now)
    assert p.depth == 8
    assert p.submit_many(requests("b", 5, Priority.REALTIME), now)
    assert answers.statuses() == {
        "a-batch-0": pb.STATUS_OVERLOADED,
        "a-batch-1": pb.STATUS_DEADLINE_EXCEEDED,
        "a-batch-2": pb.STATUS_DEADLINE_EXCEEDED,
        "b-batch-0": pb.STATUS_OVERLOADED,
        "b-batch-1": pb.STATUS_OVERLOADED,
    }
    assert (shed(p, "preempted"), shed(p, "deadline"), p.depth) == (3, 2, 8)


def test_where_the_less_urgent_requests_do_not_make_the_room_the_fair_share_decides() -> None:
    """a: 6 realtime and 2 batch in a queue of 8. b's 4 realtime: the batch lane's 2 are too few, so b
    gets its share (4) from a, a's batch ones first, then its newest realtime ones (pushed out); a's own
    further realtime request is refused (it holds more than its share), and so is b's next one (it holds
    its share)."""
    answers = Answers()
    p = pool(8, answers)
    now = time.monotonic()
    assert p.submit_many(requests("a", 6, Priority.REALTIME), now)
    assert p.submit_many(requests("a", 2, Priority.BATCH), now)
    assert p.submit_many(requests("b", 4, Priority.REALTIME), now)
    assert sorted(answers.by_id) == [b"a-batch-0", b"a-batch-1", b"a-realtime-4", b"a-realtime-5"]
    assert (shed(p, "preempted"), shed(p, "pushed_out"), p.depth) == (0, 4, 8)
    assert not p.submit_many(requests("a", 1, Priority.REALTIME), now)
    assert not p.submit_many(requests("b", 1, Priority.REALTIME), now)
