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


async def test_past_concurrency_only_live_realtime_requests_go_never_the_fill() -> None:
    """One batch holds the pool's only slot (concurrency 1, reserve 2). Five batch requests and a realtime
    one of an urgent frame whose deadline has passed are queued: the realtime request is answered
    DEADLINE_EXCEEDED and nothing goes past concurrency (the fill would have ridden the reserve in its
    place); a live realtime request then goes at once, alone, past concurrency."""
    answers = Answers()
    p = pool(32, answers)
    p.concurrency = 1
    p._delay_s = 0.0  # max_queue_delay_us 0: a batch goes at once
    p._ewma_item_s = 100e-6  # a pool that has served: a realtime batch's fill would be 20 others
    started: list[tuple[int, list[str]]] = []
    release = asyncio.Event()

    async def serve(items: list[WorkItem], spec: object = None) -> None:
        started.append((len(p._inflight), [item.request.request_id.decode() for item in items]))
        await release.wait()

    p._serve = serve  # type: ignore[method-assign]
    p.start()
    now = time.monotonic()
    assert p.submit_many(requests("a", 1, Priority.BATCH), now)
    await asyncio.sleep(0)  # that batch holds the slot
    assert p.submit_many(requests("b", 5, Priority.BATCH), now)
    expired = requests("c", 1, Priority.REALTIME, deadline=now - 1.0)
    expired[0].urgent = True
    assert p.submit_many(expired, now)
    await asyncio.sleep(0.01)
    assert started == [(0, ["a-batch-0"])]
    assert answers.statuses() == {"c-realtime-0": pb.STATUS_DEADLINE_EXCEEDED}
    live = requests("d", 1, Priority.REALTIME, deadline=now + 30.0)
    live[0].urgent = True
    assert p.submit_many(live, now)
    await asyncio.sleep(0.01)
    assert started == [(0, ["a-batch-0"]), (1, ["d-realtime-0"])]
    assert p.depth == 5  # the batch requests wait for the slot
    release.set()
    await p.stop(1.0)


async def test_the_reserve_goes_to_an_urgent_frames_request_whatever_queue_ranks_first() -> None:
    """The only slot held; a realtime request of a frame not marked realtime (not urgent) queued first for
    one model, then an urgent one for another: the urgent one goes on the reserve, though the other's queue
    ranks first (older head); the other waits for the slot."""
    answers = Answers()
    p = pool(32, answers)
    p.concurrency = 1
    p._delay_s = 0.0
    started: list[list[str]] = []
    release = asyncio.Event()

    async def serve(items: list[WorkItem], spec: object = None) -> None:
        started.append([item.request.request_id.decode() for item in items])
        await release.wait()

    p._serve = serve  # type: ignore[method-assign]
    p.start()
    now = time.monotonic()
    assert p.submit_many(requests("a", 1, Priority.BATCH), now)
    await asyncio.sleep(0)
    plain = requests("b", 1, Priority.REALTIME)  # in a frame marked interactive: not urgent
    assert p.submit_many(plain, now)
    urgent = requests("c", 1, Priority.REALTIME)
    urgent[0].request.model_name = "text-encoder"
    urgent[0].urgent = True
    assert p.submit_many(urgent, now + 0.001)
    await asyncio.sleep(0.01)
    assert started == [["a-batch-0"], ["c-realtime-0"]]
    assert p.depth == 1
    release.set()
    await p.stop(1.0)
