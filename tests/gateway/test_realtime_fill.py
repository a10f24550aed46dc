"""Batches of realtime requests: how many less urgent requests one takes (PoolDispatcher._realtime_size):
only as many as add at most ``realtime_fill_us`` of backend time by the pool's time per request, never
past the CPU stage's inline size; and what goes past ``concurrency`` on the realtime reserve. With the
real null backend and CPU stage object, serving replaced where a test holds it."""

from __future__ import annotations

import asyncio
import time

import pytest

from edgewire import pb
from gateway.dispatch.work import WorkItem
from gateway.testing import wait_for
from routing.types import Priority
from tests.gateway.test_pool_admission import Answers, pool, requests


@pytest.mark.parametrize(
    ("per_item_s", "size", "realtime", "taken"),
    [
        (0.0, 128, 1, 1),  # nothing observed yet: the realtime request alone
        (100e-6, 128, 1, 21),  # 2 ms of 0.1 ms requests: 20 others
        (10e-6, 128, 1, 32),  # cheap ones: up to the inline size (32)
        (5e-3, 128, 1, 1),  # a device's time per request: none
        (10e-6, 5, 1, 5),  # no more than are ready
        (10e-6, 128, 40, 40),  # realtime requests past the inline size: all of them, nothing else
        (100e-6, 128, 30, 32),
    ],
)
def test_a_realtime_batch_takes_others_as_far_as_their_time_allows(
    per_item_s: float, size: int, realtime: int, taken: int
) -> None:
    p = pool(256, Answers())
    assert p._realtime_fill_s == 0.002 and p._realtime_batch == 32  # the defaults
    p._ewma_item_s = per_item_s
    assert p._realtime_size(size, realtime) == taken


class HeldPool:
    """A pool of one slot (concurrency 1, reserve 2, no queue delay; a queue of ``capacity``) whose batches
    are recorded as they start (with the batches then in flight) and held until ``release`` is set; ``cut``
    runs its batcher's pass now, as the loop would next (a batch starts eagerly: recorded before the pass
    returns)."""

    def __init__(self, capacity: int = 32) -> None:
        self.answers = Answers()
        self.pool = p = pool(capacity, self.answers)
        p.concurrency = 1
        p._delay_s = 0.0  # max_queue_delay_us 0: a batch goes at once
        self.started: list[tuple[int, list[str]]] = []
        self.release = asyncio.Event()
        p._serve = self._serve  # type: ignore[method-assign]
        p.start()

    async def _serve(self, items: list[WorkItem], spec: object = None) -> None:
        self.started.append((len(self.pool._inflight), [item.request.request_id.decode() for item in items]))
        await self.release.wait()

    def submit(self, items: list[WorkItem]) -> None:
        """Queue ``items`` now (after whatever was queued before), then the batcher's pass."""
        assert self.pool.submit_many(items, time.monotonic())
        self.pool._batch_pass()

    async def close(self) -> None:
        self.release.set()
        await self.pool.stop(1.0)


def urgent(items: list[WorkItem]) -> list[WorkItem]:
    for item in items:
        item.urgent = True
    return items


async def test_past_concurrency_only_live_realtime_requests_go_never_the_fill() -> None:
    """One batch holds the pool's only slot (concurrency 1, reserve 2). Five batch requests and a realtime
    one of an urgent frame whose deadline has passed are queued: the realtime request is answered
    DEADLINE_EXCEEDED and nothing goes past concurrency (the fill would have ridden the reserve in its
    place); a live realtime request then goes at once, alone, past concurrency."""
    held = HeldPool()
    held.pool._ewma_item_s = 100e-6  # a pool that has served: a realtime batch's fill would be 20 others
    now = time.monotonic()
    held.submit(requests("a", 1, Priority.BATCH))  # holds the slot
    held.submit(requests("b", 5, Priority.BATCH))
    held.submit(urgent(requests("c", 1, Priority.REALTIME, deadline=now - 1.0)))
    assert held.started == [(0, ["a-batch-0"])]
    assert held.answers.statuses() == {"c-realtime-0": pb.STATUS_DEADLINE_EXCEEDED}
    held.submit(urgent(requests("d", 1, Priority.REALTIME, deadline=now + 30.0)))
    assert held.started == [(0, ["a-batch-0"]), (1, ["d-realtime-0"])]
    assert held.pool.depth == 5  # the batch requests wait for the slot
    await held.close()


async def test_the_reserve_goes_to_an_urgent_frames_request_whatever_queue_ranks_first() -> None:
    """The only slot held; a realtime request of a frame not marked realtime (not urgent) queued first for
    one model, then an urgent one for another: the urgent one goes on the reserve, though the other's queue
    ranks first (older head); the other waits for the slot."""
    held = HeldPool()
    held.submit(requests("a", 1, Priority.BATCH))
    held.submit(requests("b", 1, Priority.REALTIME))  # in a frame marked interactive: not urgent
    other_model = urgent(requests("c", 1, Priority.REALTIME))
    other_model[0].request.model_name = "text-encoder"
    held.submit(other_model)
    assert [ids for _, ids in held.started] == [["a-batch-0"], ["c-realtime-0"]]
    assert held.pool.depth == 1
    await held.close()


async def test_the_reserve_goes_to_the_agent_served_least_not_to_the_oldest_request() -> None:
    """The slot and both reserve calls held by a's batch and two realtime requests; a's third realtime
    request (another model) is queued, then b's: once the calls end, b's goes first (served less; fair
    queueing over the pool's queues, gateway/dispatch/lanes.py Counts), though a's is older. Before, one
    agent's realtime requests in other queues went first, all of them."""
    held = HeldPool()
    held.submit(requests("a", 1, Priority.BATCH))  # the slot
    for model in ("rank-mlp", "text-encoder"):  # the reserve
        part = urgent(requests("a", 1, Priority.REALTIME))
        part[0].request.model_name = model
        part[0].request.request_id = f"a-{model}".encode()
        held.submit(part)
    waiting = urgent(requests("a", 1, Priority.REALTIME))
    waiting[0].request.model_name = "image-classifier"
    held.submit(waiting)
    held.submit(urgent(requests("b", 1, Priority.REALTIME)))
    assert [ids for _, ids in held.started] == [["a-batch-0"], ["a-rank-mlp"], ["a-text-encoder"]]
    assert held.pool.depth == 2
    held.release.set()
    await wait_for(lambda: held.pool.depth == 0, what="the queued realtime requests' batches")
    assert [ids for _, ids in held.started[3:]] == [["b-realtime-0"], ["a-realtime-0"]]
    await held.close()
