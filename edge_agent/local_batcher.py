"""Micro-batches for the local tier: requests for one (model, version), from any caller, share a model
call of up to ``LOCAL_MAX_BATCH`` requests or what arrived within ``LOCAL_LINGER_S``."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import structlog

from edge_agent.callers import Callers
from edge_agent.errors import ErrorCounts, ErrorReason
from edge_agent.stats import AgentStats
from edgewire import now_unix_us, pb

if TYPE_CHECKING:
    from edge_agent.local import LocalTier

log = structlog.get_logger("edge_agent")

LOCAL_MAX_BATCH: Final = 32
LOCAL_LINGER_S: Final = 0.002

ModelKey = tuple[str, str]  # (model name, version)


class LocalBatcher:
    """Queues requests for the local tier per model and serves each batch in a task of its own.

    ``busy`` counts requests queued or being served; ``on_done`` is called as each batch finishes.
    """

    def __init__(
        self,
        tier: LocalTier,
        callers: Callers,
        stats: AgentStats,
        errors: ErrorCounts,
        on_done: Callable[[], None],
    ) -> None:
        self.tier = tier
        self._callers = callers
        self._stats = stats
        self._errors = errors
        self._on_done = on_done
        self._queue: dict[ModelKey, list[tuple[bytes, pb.InferRequest]]] = {}
        self._timers: dict[ModelKey, asyncio.TimerHandle] = {}
        self._serving: dict[asyncio.Task[None], int] = {}  # batch task -> its requests

    @property
    def busy(self) -> int:
        return sum(len(q) for q in self._queue.values()) + sum(self._serving.values())

    def serves(self, model: str, version: str) -> bool:
        return self.tier.serves(model, version)

    def add(self, caller: bytes, batches: dict[ModelKey, list[pb.InferRequest]]) -> None:
        for key, requests in batches.items():
            queue = self._queue.setdefault(key, [])
            queue.extend((caller, request) for request in requests)
            if len(queue) >= LOCAL_MAX_BATCH:
                self._flush(key)
            elif key not in self._timers:
                # Micro-batching: requests from many callers share one model call.
                loop = asyncio.get_running_loop()
                self._timers[key] = loop.call_later(LOCAL_LINGER_S, self._flush, key)

    def _flush(self, key: ModelKey) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        batch = self._queue.pop(key, [])
        if batch:
            task = asyncio.create_task(self._serve(batch), name="local-batch")
            self._serving[task] = len(batch)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._serving.pop(task, None)
        self._on_done()

    async def _serve(self, batch: list[tuple[bytes, pb.InferRequest]]) -> None:
        wall = now_unix_us()
        live = [(c, r) for c, r in batch if not r.deadline_unix_us or r.deadline_unix_us > wall]
        for caller, request in batch:
            if request.deadline_unix_us and request.deadline_unix_us <= wall:
                self._callers.fail_fast(caller, request, "local_busy")
        if not live:
            return
        try:
            responses = await self.tier.serve([r for _, r in live])
        except Exception:  # answer every caller; a local-tier bug must not leave them waiting
            self._errors.count(ErrorReason.LOCAL_TIER)
            first = live[0][1]
            log.exception(
                "local tier failed", model=first.model_name, version=first.model_version, requests=len(live)
            )
            responses = [
                pb.InferResponse(
                    request_id=r.request_id,
                    status=pb.STATUS_INTERNAL,
                    error_message="local tier failed",
                    model_name=r.model_name,
                )
                for _, r in live
            ]
        self._stats.local += len(responses)
        by_caller: defaultdict[bytes, list[pb.InferResponse]] = defaultdict(list)
        for (caller, _), response in zip(live, responses, strict=True):
            by_caller[caller].append(response)
        for caller, answers in by_caller.items():
            self._callers.answer(caller, answers)

    async def aclose(self) -> None:
        """Drop what is queued (its callers time out) and stop the batches being served."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._queue.clear()
        tasks = list(self._serving)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
