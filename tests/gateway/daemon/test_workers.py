"""The CPU stage's worker processes: tasks in order, errors handed back, a dead or hung worker replaced."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.dispatch.workers import TaskTimedOut, WorkerDied, WorkerPool


def double(x: int) -> int:
    return 2 * x


def fail(message: str) -> None:
    raise ValueError(message)


def die() -> None:
    os._exit(3)


def echo(data: bytes) -> int:
    return len(data)


def sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


@asynccontextmanager
async def running(**options: Any) -> AsyncIterator[WorkerPool]:
    """A started one-worker pool (forkserver), closed afterwards."""
    workers = WorkerPool(1, multiprocessing.get_context("forkserver"), **options)
    workers.start()
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
async def pool() -> AsyncIterator[WorkerPool]:
    async with running() as workers:
        yield workers


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


async def test_a_dead_worker_fails_its_task_is_replaced_and_queued_tasks_run(pool: WorkerPool) -> None:
    """The task that killed its worker fails with WorkerDied; the one waiting behind it in the dead worker's
    pipe never started, so it runs on the new worker with everything else that was queued."""
    (victim,) = pool.pids()
    dying = pool.submit(die)
    after = [pool.submit(double, i) for i in range(5)]
    with pytest.raises(WorkerDied):
        await dying
    assert await asyncio.gather(*after) == [2 * i for i in range(5)]
    assert pool.restarts == 1
    assert pool.pids() != [victim]


async def test_a_task_past_the_timeout_gets_its_worker_killed_and_the_rest_run() -> None:
    """A task running past task_timeout_s fails with TaskTimedOut once its worker is gone (not with its own
    result, 60 s later); the worker is replaced, the task queued behind it is served by the new one, and
    the timeout is counted. The watchdog's own record says the task ran past the timeout before the kill."""
    timeouts: list[int] = []
    async with running(task_timeout_s=0.4, on_timeout=lambda: timeouts.append(1)) as workers:
        (victim,) = workers.pids()
        hung = workers.submit(sleep_then, 60.0, 1)
        behind = [workers.submit(double, i) for i in range(3)]
        with pytest.raises(TaskTimedOut, match=r"ran (\d+\.\d) s \(task_timeout_s 0\.4\)") as caught:
            await asyncio.wait_for(hung, timeout=10)
        ran = re.search(r"ran (\d+\.\d) s", str(caught.value))
        assert ran is not None and float(ran.group(1)) >= 0.4, caught.value
        assert await asyncio.gather(*behind) == [0, 2, 4]
        assert workers.timeouts == 1
        assert timeouts == [1]
        assert workers.restarts == 1
        assert workers.pids() != [victim]


async def test_a_task_within_the_timeout_is_left_alone() -> None:
    """Tasks that each finish inside the timeout are never killed, however many run back to back."""
    async with running(task_timeout_s=1.0) as workers:
        (pid,) = workers.pids()
        assert await asyncio.gather(*(workers.submit(sleep_then, 0.2, i) for i in range(8))) == list(range(8))
        assert workers.timeouts == 0
        assert workers.pids() == [pid]


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
