"""Start a coroutine at once, on the caller's stack; a task only if it has to wait.

A batch whose every step runs on the event loop (a pipeline that only moves bytes, an in-process backend
that answers at once) is served by the time its first step returns: a task for it would only add a loop
tick and the task's own cost. :func:`start_eagerly` runs the coroutine until it finishes or first waits;
only a coroutine that waits becomes a task, which goes on from where it stopped. (Python 3.12's eager task
factory does this for every task; the gateway runs on 3.11 and wants it for batches only.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Finished:
    """A coroutine that ran to its end inline: its result (or the exception it raised) is here."""

    __slots__ = ("error", "result")

    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result = result
        self.error = error


def start_eagerly(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> Finished | asyncio.Task[T]:
    """Run ``coro`` now until it ends (:class:`Finished`) or first waits (a task that carries on)."""
    try:
        waiting_on = _blocking(coro.send(None))
    except StopIteration as stop:
        return Finished(stop.value)
    except BaseException as exc:  # noqa: BLE001  (handed to the caller, as a task's exception would be)
        return Finished(error=exc)
    return asyncio.get_running_loop().create_task(_carry_on(coro, waiting_on), name=name)


def _blocking(yielded: Any) -> Any:
    """What a coroutine yielded, with the flag a future sets when awaited cleared, as a task clears it."""
    if yielded is not None:
        yielded._asyncio_future_blocking = False
    return yielded


async def _carry_on(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    """The rest of a coroutine that stopped at ``waiting_on`` (what it yielded: a future, or None for a
    bare yield). Each future it waits on is waited for here, then the coroutine is resumed and reads the
    future's outcome itself, as under a task. Cancelling this task cancels that future and throws the
    CancelledError into the coroutine, as cancelling the coroutine's own task would."""
    while True:
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait([waiting_on])
        except asyncio.CancelledError as cancel:
            if waiting_on is not None:
                waiting_on.cancel()
            try:
                waiting_on = _blocking(coro.throw(cancel))
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        try:
            waiting_on = _blocking(coro.send(None))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
