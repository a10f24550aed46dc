"""start_eagerly: a coroutine that never waits finishes inline; one that waits carries on as a task,
with results, errors and cancellation as a task of its own would have them."""

from __future__ import annotations

import asyncio

import pytest

from gateway.dispatch.eager import Finished, start_eagerly
from gateway.testing import wait_for


async def test_a_coroutine_that_never_waits_finishes_inline() -> None:
    steps: list[str] = []

    async def quick() -> int:
        steps.append("ran")
        return 7

    started = start_eagerly(quick())
    assert isinstance(started, Finished)
    assert started.result == 7 and started.error is None
    assert steps == ["ran"]  # before any loop tick


async def test_an_error_raised_inline_is_handed_back() -> None:
    async def broken() -> None:
        raise ValueError("bad batch")

    started = start_eagerly(broken())
    assert isinstance(started, Finished)
    assert isinstance(started.error, ValueError)


async def test_a_coroutine_that_waits_carries_on_as_a_task() -> None:
    loop = asyncio.get_running_loop()
    first: asyncio.Future[int] = loop.create_future()
    second: asyncio.Future[int] = loop.create_future()
    steps: list[object] = []

    async def waits() -> int:
        steps.append("start")
        a = await first
        steps.append(a)
        await asyncio.sleep(0)  # a bare yield
        try:
            await second
        except KeyError as exc:
            steps.append(repr(exc))
        return a + 1

    started = start_eagerly(waits())
    assert isinstance(started, asyncio.Task)
    assert steps == ["start"]
    first.set_result(41)
    await wait_for(lambda: steps == ["start", 41], what="the task resumed past the first future")
    second.set_exception(KeyError("gone"))  # read by the coroutine itself, where it awaits
    assert await started == 42
    assert steps == ["start", 41, "KeyError('gone')"]


async def test_cancelling_the_task_reaches_the_coroutine_and_its_future() -> None:
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    handled: list[str] = []

    async def stuck() -> None:
        try:
            await never
        except asyncio.CancelledError:
            handled.append("answered before stopping")
            raise

    started = start_eagerly(stuck())
    assert isinstance(started, asyncio.Task)
    await asyncio.sleep(0)
    started.cancel()
    with pytest.raises(asyncio.CancelledError):
        await started
    assert handled == ["answered before stopping"]
    assert never.cancelled()
