"""The CPU stage's worker processes: tasks in order, errors handed back, a dead worker replaced."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from collections.abc import AsyncIterator

import pytest

from gateway.dispatch.workers import WorkerDied, WorkerPool


def double(x: int) -> int:
    return 2 * x


def fail(message: str) -> None:
    raise ValueError(message)


def die() -> None:
    os._exit(3)


def echo(data: bytes) -> int:
    return len(data)


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    workers = WorkerPool(1, multiprocessing.get_context("forkserver"))
    workers.start()
    try:
        yield workers
    finally:
        workers.close()


async def test_tasks_beyond_the_workers_queue_and_all_complete(pool: WorkerPool) -> None:
    """More tasks than one worker takes at once are queued and all come back with their own results."""
    results = await asyncio.gather(*(pool.submit(double, i) for i in range(50)))
    assert results == [2 * i for i in range(50)]


async def test_a_task_error_comes_back_and_the_worker_goes_on(pool: WorkerPool) -> None:
    """An exception raised by a task is its caller's; the same worker serves the next task."""
    (pid,) = pool.pids()
    with pytest.raises(ValueError, match="bad input"):
        await pool.submit(fail, "bad input")
    assert await pool.submit(double, 21) == 42
    assert pool.pids() == [pid]
    assert pool.restarts == 0


async def test_unpicklable_arguments_fail_only_that_task(pool: WorkerPool) -> None:
    """Arguments that cannot be pickled fail the task before anything is written to the worker."""
    with pytest.raises(Exception, match="pickle"):
        await pool.submit(double, lambda: 1)
    assert await pool.submit(double, 2) == 4


async def test_a_dead_worker_fails_its_tasks_is_replaced_and_queued_tasks_run(pool: WorkerPool) -> None:
    """The task that killed its worker (and the one waiting behind it) fail with WorkerDied; a new worker
    starts and runs what was queued."""
    (victim,) = pool.pids()
    dying = pool.submit(die)
    after = [pool.submit(double, i) for i in range(5)]
    with pytest.raises(WorkerDied):
        await dying
    outcomes = await asyncio.gather(*after, return_exceptions=True)
    served = [o for o in outcomes if not isinstance(o, BaseException)]
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert all(isinstance(o, WorkerDied) for o in failed)
    assert len(failed) <= 1  # at most the one task already waiting in the dead worker's pipe
    assert served == [2 * i for i in range(5)][len(failed) :]
    assert pool.restarts == 1
    assert pool.pids() != [victim]


async def test_large_tasks_go_through(pool: WorkerPool) -> None:
    """Tasks far larger than the pipe's buffer are written to an idle worker and arrive whole."""
    sizes = [1 << 20, 3 << 20, 10, 2 << 20]
    assert await asyncio.gather(*(pool.submit(echo, b"x" * n) for n in sizes)) == sizes


async def test_close_fails_what_is_left_and_is_safe_twice() -> None:
    """Closing fails queued tasks with WorkerDied instead of leaving their callers waiting."""
    workers = WorkerPool(1, multiprocessing.get_context("forkserver"))
    workers.start()
    queued = [workers.submit(double, i) for i in range(3)]
    workers.close()
    workers.close()
    outcomes = await asyncio.gather(*queued, return_exceptions=True)
    assert all(isinstance(o, WorkerDied) for o in outcomes)
