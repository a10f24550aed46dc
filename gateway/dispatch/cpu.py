"""The CPU stage's executor: pre- and post-processing off the event loop, in worker processes.

The GIL would serialise tokenisation, feature assembly and top-k with the event loop, so batches go to a
process pool (``mode = "process"``): the loop keeps reading carriers, acking and answering health checks
while the workers use the other cores. A worker that dies breaks Python's pool; the stage replaces the
pool and the affected batch fails with a retryable error, which the dispatcher reroutes or answers
UNAVAILABLE. ``mode = "thread"`` runs the same functions on a thread (for debugging, or one-core hosts).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal, TypeVar

import numpy as np
import structlog

from gateway.backends.base import BackendError, ModelSpec
from gateway.ops.metrics import GatewayMetrics
from gateway.pipeline import worker
from gateway.pipeline.base import Prepared
from gateway.pipeline.registry import CHEAP_PIPELINES

log = structlog.get_logger("gateway.cpu")
CpuMode = Literal["process", "thread"]
ON_LOOP_MAX_BYTES = 64 << 10
"""Small batches (``inline_max_requests``, at most this many bytes of requests) of the pipelines that are
cheap per request (``CHEAP_PIPELINES``) run on the event loop itself."""
T = TypeVar("T")


class CpuStage:
    """A bounded pool of CPU workers shared by every pool dispatcher."""

    def __init__(
        self, workers: int, mode: CpuMode, metrics: GatewayMetrics, *, inline_max_requests: int = 4
    ) -> None:
        self.workers = workers
        self.mode = mode
        self._metrics = metrics
        self._executor: Executor | None = None
        # A batch this small costs less to process than to ship to a worker process and back (about a
        # millisecond of pickling and IPC): it runs on one local thread instead.
        self.inline_max_requests = inline_max_requests
        self._inline: ThreadPoolExecutor | None = None
        self.restarts = 0

    def start(self) -> None:
        self._executor = self._new_executor()
        if self.mode == "process" and self.inline_max_requests:
            self._inline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkgw-cpu-inline")

    def _new_executor(self) -> Executor:
        if self.mode == "thread":
            return ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hkgw-cpu")
        # forkserver: workers are forked from a clean server process, never from this one with its
        # ZeroMQ and ONNX Runtime threads; the pipelines are imported once in the server.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["gateway.pipeline.worker"])
        return ProcessPoolExecutor(
            max_workers=self.workers, mp_context=context, initializer=worker.die_with_parent
        )

    async def warm_up(self) -> list[int]:
        """Start every worker now (not on the first request); returns their pids."""
        loop = asyncio.get_running_loop()
        assert self._executor is not None
        return list(
            await asyncio.gather(
                *(loop.run_in_executor(self._executor, worker.ping) for _ in range(self.workers))
            )
        )

    def pids(self) -> list[int]:
        processes = getattr(self._executor, "_processes", None) or {}
        return sorted(processes)

    async def prepare(self, pipeline: str, spec: ModelSpec, payloads: Sequence[bytes]) -> Prepared:
        return await self._run(pipeline, payloads, worker.prepare_batch, pipeline, spec, payloads)

    async def finish(
        self, pipeline: str, prepared: Prepared, outputs: Mapping[str, np.ndarray], payloads: Sequence[bytes]
    ) -> list[bytes]:
        return await self._run(
            pipeline,
            payloads,
            worker.finish_batch,
            pipeline,
            worker.without_inputs(prepared),
            outputs,
            payloads,
        )

    async def _run(self, pipeline: str, payloads: Sequence[bytes], fn: Callable[..., T], *args: Any) -> T:
        if self._inline is not None and len(payloads) <= self.inline_max_requests:
            if pipeline in CHEAP_PIPELINES and sum(map(len, payloads)) <= ON_LOOP_MAX_BYTES:
                # Tens of microseconds of work: a thread hand-off each way would cost more than that
                # and add its own latency. Image decoding (milliseconds) never runs here, nor a
                # request big enough (thousands of candidates) to hold the loop up.
                return fn(*args)
            return await asyncio.get_running_loop().run_in_executor(self._inline, fn, *args)
        executor = self._executor
        if executor is None:
            raise BackendError("CPU stage is closed", retryable=True, status="UNAVAILABLE")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(executor, fn, *args)
        except BrokenProcessPool as exc:
            self._replace(executor)
            raise BackendError(
                "CPU worker died; batch not processed", retryable=True, status="UNAVAILABLE"
            ) from exc

    def _replace(self, broken: Executor) -> None:
        if self._executor is not broken:  # another batch already replaced it
            return
        self.restarts += 1
        self._metrics.cpu_worker_restarts.inc()
        log.error("CPU worker died; replacing the pool", restarts=self.restarts)
        broken.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()

    def close(self) -> None:
        if self._inline is not None:
            self._inline.shutdown(wait=False, cancel_futures=True)
            self._inline = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def default_workers() -> int:
    """All cores but the one the event loop needs, at least one."""
    import os

    return max(1, len(os.sched_getaffinity(0)) - 1)
