"""The CPU stage's executor: pre- and post-processing, in worker processes unless it is cheaper here.

The GIL would serialise tokenisation, feature assembly and top-k with the event loop, so batches go to
worker processes (``mode = "process"``, workers.py) and their data through a shared-memory arena
(arena.py): the loop keeps reading carriers, acking and answering health checks while the workers use the
other cores. What costs less than the hand-off stays in this process (:meth:`CpuStage._local`): small
batches of the cheap pipelines, and every batch of fixed-width wire tensors (the loop would spend as much
serializing them for a worker as decoding them). A worker that dies (or is killed for a task past
``task_timeout_s``) is replaced and the batch it held fails with :class:`CpuTaskFailed`: the dispatcher
retries its requests one by one, in workers (``in_worker``), so that only the one at fault fails.
``mode = "thread"`` runs the same functions on threads (for debugging, or one-core hosts).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

import numpy as np
import structlog

from edgewire import pb
from gateway.dispatch.worker_start import start_worker
from gateway.dispatch.workers import TaskTimedOut, WorkerDied, WorkerPool, start_forkserver
from gateway.ops.metrics import GatewayMetrics
from inference.backends.base import BackendError, ModelSpec
from inference.pipeline import worker
from inference.pipeline.arena import FeatureArena, Slot, remove_leftover_arenas, shm_free_bytes
from inference.pipeline.base import Prepared
from inference.pipeline.registry import CHEAP_PIPELINES, LOOP_PIPELINES
from service.logs import LoggingConfig, static_fields

log = structlog.get_logger("gateway.cpu")
CpuMode = Literal["process", "thread"]
ON_LOOP_MAX_BYTES = 64 << 10
"""Small batches (``inline_max_requests``, at most this many bytes of requests) of the pipelines that are
cheap per request (``CHEAP_PIPELINES``) run on the event loop itself."""
T = TypeVar("T")


class CpuTaskFailed(BackendError):
    """A batch's CPU task did not finish: its worker died (``timed_out`` False) or was killed for running
    past ``task_timeout_s`` (True). One of the batch's requests may be the cause; the dispatcher retries
    the others one by one (``PoolDispatcher``), in workers, where a hang can be stopped again."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        if timed_out:
            super().__init__(message, retryable=False, status="INTERNAL")
        else:
            super().__init__(message, retryable=True, status="UNAVAILABLE")
        self.timed_out = timed_out


class CpuStage:
    """A bounded pool of CPU workers shared by every pool dispatcher."""

    def __init__(
        self,
        workers: int,
        mode: CpuMode,
        metrics: GatewayMetrics,
        *,
        inline_max_requests: int = 32,
        arena_slots: int = 0,
        arena_slot_bytes: int = 8 << 20,
        task_timeout_s: float = 0.0,
        logging: LoggingConfig | None = None,
    ) -> None:
        self.workers = workers
        self._logging = logging  # applied in each worker process, so what they log is JSON lines too
        self.mode = mode
        self._metrics = metrics
        self._threads: ThreadPoolExecutor | None = None  # mode "thread"
        self._processes: WorkerPool | None = None  # mode "process"
        # A batch this small costs less to process than to ship to a worker process and back (about a
        # millisecond of pickling and IPC): it runs on one local thread instead.
        self.inline_max_requests = inline_max_requests
        self._inline: ThreadPoolExecutor | None = None
        self.restarts = 0
        # Prepared tensors come back through shared memory (process mode only; see arena.py).
        self._arena_slots = arena_slots if mode == "process" else 0
        self._arena_slot_bytes = arena_slot_bytes
        self.arena: FeatureArena | None = None
        self.task_timeout_s = task_timeout_s  # process mode: a longer task gets its worker killed

    def start(self) -> None:
        if self._arena_slots and self.arena is None:
            remove_leftover_arenas()  # first: a killed predecessor's block may fill a container's /dev/shm
            slots = self._arena_slots_that_fit()
            if slots:
                self.arena = FeatureArena(slots, self._arena_slot_bytes)
        if self.mode == "thread":
            self._threads = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hkgw-cpu")
        else:
            # forkserver: workers are forked from a clean server process, never from this one with its
            # ZeroMQ and ONNX Runtime threads; the pipelines are imported once in the server.
            context = multiprocessing.get_context("forkserver")
            start_forkserver()  # a no-op when the CLI started it early (gateway/cli.py)
            self._processes = WorkerPool(
                self.workers,
                context,
                initializer=functools.partial(start_worker, self._logging, static_fields()),
                on_restart=self._restarted,
                task_timeout_s=self.task_timeout_s,
                on_timeout=self._metrics.cpu_task_timeouts.inc,
            )
            self._processes.start()
            self._metrics.cpu_workers_busy.set_function(self.busy_workers)
            if self.inline_max_requests:
                self._inline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkgw-cpu-inline")

    def _arena_slots_that_fit(self) -> int:
        """The configured slots, or as many as half of /dev/shm's free room holds (a container's is often
        64 MiB): a write past a full tmpfs is SIGBUS, not an error. Fewer than 2: no arena, the pipe."""
        wanted, slot = self._arena_slots, self._arena_slot_bytes
        free = shm_free_bytes()
        if free is None or free >= 2 * wanted * slot:
            return wanted
        fitting = free // 2 // slot
        fitting = fitting if fitting >= 2 else 0
        event = (
            "little shared memory: a smaller CPU arena" if fitting else "no room for the CPU arena: pipe only"
        )
        log.warning(event, wanted_slots=wanted, slots=fitting, slot_bytes=slot, shm_free_bytes=free)
        return fitting

    async def warm_up(self) -> list[int]:
        """Start every worker now (not on the first request); returns their pids."""
        return list(await asyncio.gather(*(self._in_worker(worker.ping) for _ in range(self.workers))))

    def pids(self) -> list[int]:
        return self._processes.pids() if self._processes is not None else []

    def busy_workers(self) -> int:
        """Worker processes running a task now (``hkgw_cpu_workers_busy``)."""
        return self._processes.busy() if self._processes is not None else 0

    async def prepare(
        self,
        pipeline: str,
        spec: ModelSpec,
        requests: Sequence[pb.InferRequest],
        *,
        in_worker: bool = False,
        payloads: Sequence[memoryview | bytes] | None = None,
    ) -> Prepared:
        """The batch's input tensors; call :meth:`release` once the backend call that used them is over.

        Run on the event loop or a local thread (see :meth:`_local`) with the requests as they are, or in a
        worker process: the requests serialized into an arena slot, the tensors written back there.
        ``in_worker``: in a worker process whatever the batch (a retry of requests whose batch hung or
        killed a worker: there the task timeout applies again, and a crash takes only a worker down).
        ``payloads``: the requests' serialized bytes where the caller has them (the frame they came in),
        so a worker's batch is not serialized again, and here the pipelines that can read them in place
        do (wire tensors: one copy into the batch, none for a batch of one, whose inputs are then read-only
        views of the frame).
        """
        size = None if payloads is None else sum(map(len, payloads))  # free: the frame's own bytes
        local = self._local(pipeline, requests, spec, in_worker, size)
        if local == "loop":
            prepared = worker.prepare_requests(pipeline, spec, requests, payloads)
            prepared.where = local
            return prepared
        if local == "thread":
            prepared = await self._in_thread(worker.prepare_requests, pipeline, spec, requests, payloads)
            prepared.where = local
            return prepared
        if payloads is None:
            payloads = [request.SerializeToString() for request in requests]
        arena = self.arena
        slot = None if arena is None else arena.borrow()
        if arena is None or slot is None:
            if arena is not None:
                self._metrics.child(self._metrics.cpu_arena_fallbacks, "no_free_slot").inc()
            return await self._in_worker(worker.prepare_batch, pipeline, spec, [bytes(p) for p in payloads])
        lengths = arena.put_payloads(slot, payloads)
        shipped = () if lengths is not None else [bytes(p) for p in payloads]  # a pipe takes bytes
        prepared = await self._in_worker(
            worker.prepare_batch, pipeline, spec, shipped, slot, lengths or (), lent=slot
        )
        if not prepared.placed:
            arena.give_back(slot)
            if prepared.inputs:  # not placed: too large for a slot, or object (BYTES) arrays
                reason = (
                    "too_large"
                    if all(a.dtype.kind != "O" for a in prepared.inputs.values())
                    else "bytes_tensors"
                )
                self._metrics.child(self._metrics.cpu_arena_fallbacks, reason).inc()
            return prepared
        prepared.inputs = arena.views(prepared.placed)
        prepared.slot = slot
        return prepared

    def release(self, prepared: Prepared) -> None:
        """The backend is done with the batch's tensors: their arena slot may take the next batch."""
        if prepared.slot is not None and self.arena is not None:
            prepared.inputs = {}
            self.arena.give_back(prepared.slot)
            prepared.slot = None

    async def finish(
        self,
        pipeline: str,
        prepared: Prepared,
        outputs: Mapping[str, np.ndarray],
        requests: Sequence[pb.InferRequest],
        *,
        in_worker: bool = False,
    ) -> list[bytes]:
        """Per kept request, its outputs as response bytes. ``requests`` (the kept ones) decide where it
        runs, with ``in_worker`` as in :meth:`prepare`; they are not sent: what finish needs beyond the
        outputs travels in ``prepared.extras``."""
        # Where prepare ran, as prepare decided (the kept requests are no larger): asked again only for a
        # batch prepared elsewhere.
        local = prepared.where
        if local is None or in_worker:
            local = self._local(pipeline, requests, prepared.spec, in_worker)
        if local == "loop":  # nothing is shipped: finish reads no inputs, so no copy without them
            return worker.finish_batch(pipeline, prepared, outputs)
        light = worker.without_inputs(prepared)
        if local == "thread":
            return await self._in_thread(worker.finish_batch, pipeline, light, outputs)
        return await self._in_worker(worker.finish_batch, pipeline, light, outputs)

    def _local(
        self,
        pipeline: str,
        requests: Sequence[pb.InferRequest],
        spec: ModelSpec | None,
        in_worker: bool = False,
        size: int | None = None,
    ) -> Literal["loop", "thread", ""]:
        """Where a batch runs in this process: "loop", "thread", or "" (a worker process).

        On the event loop: pipelines that only move bytes (``LOOP_PIPELINES``), at any size, for models
        whose tensors are all fixed-width (BYTES tensors are decoded element by element in Python: their
        batches go to the local thread or a worker, never the loop); and batches of
        at most ``inline_max_requests`` of the pipelines that cost tens of microseconds per request
        (``CHEAP_PIPELINES``, up to ``ON_LOOP_MAX_BYTES``), where a hand-off each way would cost more than
        the work and add its own latency. Image decoding (milliseconds) never runs there, nor a request
        big enough (thousands of candidates) to hold the loop up: small batches of those go to one local
        thread. In ``thread`` mode everything else runs on the threads; with ``in_worker``, everything runs
        in a worker process when there are any.
        """
        if in_worker and self._processes is not None:
            return ""
        cheap = pipeline in CHEAP_PIPELINES
        if pipeline in LOOP_PIPELINES:
            if spec is not None and _fixed_width(spec):
                return "loop"
            cheap = False  # BYTES tensors: never on the loop, whatever the batch's size
        if self._processes is None:
            return "thread"
        if self._inline is None or len(requests) > self.inline_max_requests:
            return ""
        if size is None:
            size = sum(r.ByteSize() for r in requests)
        if cheap and size <= ON_LOOP_MAX_BYTES:
            return "loop"
        return "thread"

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the stage's threads (``thread`` mode) or its one inline thread."""
        executor = self._threads if self._processes is None else self._inline
        if executor is None:
            raise BackendError("CPU stage is closed", retryable=True, status="UNAVAILABLE")
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def _in_worker(self, fn: Callable[..., T], *args: Any, lent: Slot | None = None) -> T:
        """``fn(*args)`` in a worker. ``lent``: an arena slot the call writes into, given back when the
        call fails, or, when the caller is cancelled, once the worker has really stopped writing (a
        cancelled await does not stop a running worker)."""
        if self._threads is not None:
            return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)
        processes = self._processes
        if processes is None:
            self._give_back(lent)
            raise BackendError("CPU stage is closed", retryable=True, status="UNAVAILABLE")
        abandoned = None if lent is None else (lambda: self._give_back(lent))
        future = processes.submit(fn, *args, on_abandoned=abandoned)
        try:
            result: T = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # answered, then cancelled before we resumed
                self._give_back(lent)
            raise
        except BaseException as exc:
            self._give_back(lent)
            if isinstance(exc, TaskTimedOut):
                # Not rerouted: the same batch would most likely hang the next worker too (the dispatcher
                # retries its requests one by one instead).
                raise CpuTaskFailed(
                    f"processing ran past the gateway's CPU task_timeout_s ({self.task_timeout_s:g} s)",
                    timed_out=True,
                ) from exc
            if isinstance(exc, WorkerDied):
                raise CpuTaskFailed(
                    "a gateway CPU worker died while processing the batch", timed_out=False
                ) from exc
            raise
        return result

    def _give_back(self, slot: Slot | None) -> None:
        if slot is not None and self.arena is not None:
            self.arena.give_back(slot)

    def _restarted(self) -> None:
        self.restarts += 1
        self._metrics.cpu_worker_restarts.inc()

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._inline is not None:
            self._inline.shutdown(wait=False, cancel_futures=True)
            self._inline = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None


def _fixed_width(spec: ModelSpec) -> bool:
    """True when every input and output of the model has a fixed-width dtype (no BYTES / object)."""
    return all(np.dtype(t.dtype).kind != "O" for t in (*spec.inputs, *spec.outputs))


def default_workers() -> int:
    """All cores but the one the event loop needs, at least one."""
    import os

    return max(1, len(os.sched_getaffinity(0)) - 1)
