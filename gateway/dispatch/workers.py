"""The CPU stage's worker processes, fed straight from the event loop.

Each worker has one duplex pipe (a socket pair) to the gateway. The gateway writes tasks into it (the
one the worker runs and at most one more, so that the worker starts the next the moment it answers) and
reads the answers from the loop's reader callback; nothing else runs in between. Python's
ProcessPoolExecutor puts two helper threads in the gateway process (a manager and a queue feeder) that
need the GIL for every hand-off; under load the event loop holds it and the hand-offs wait. Here a
finished task's answer wakes the loop like any socket (bench/ingest_bench.py with the same pools: 8.7k ->
10.5k records/s).

A worker that dies (EOF on its pipe) fails the task it was running with :class:`WorkerDied` and is
replaced; the task waiting behind it in its pipe never started and goes back to the front of the queue,
for the remaining and new workers. A task that runs longer than ``task_timeout_s`` (a pathological input
that makes a decoder spin, a deadlock in a native library) gets its worker killed: the task fails with
:class:`TaskTimedOut` once the process is gone (so it writes nothing more to shared memory), and the
worker is replaced like a dead one. Tasks whose caller stopped waiting still run to the end (a process
cannot be interrupted mid-task without losing it): ``on_abandoned`` is told when such a task is over.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import multiprocessing.connection
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

import structlog

log = structlog.get_logger("gateway.cpu")
ProcessContext = (
    multiprocessing.context.ForkServerContext
    | multiprocessing.context.SpawnContext
    | multiprocessing.context.ForkContext
)
"""A start method's context: what ``multiprocessing.get_context(<method>)`` returns (a plain BaseContext
has no ``Process`` to start)."""
QUEUED_TASK_MAX_BYTES = 16 << 10
"""A task waits in a busy worker's pipe only if it is this small: the pipe's buffer takes it without
blocking the loop. Larger ones (a finish task with its outputs, requests that did not fit the arena) are
written when the worker is idle and reading."""


FORKSERVER_PRELOAD = ("inference.pipeline.worker",)
"""Imported once in the forkserver, so that every worker forked from it starts with the pipelines loaded."""


def start_forkserver() -> None:
    """Start the forkserver now, if it is not running: it imports ``FORKSERVER_PRELOAD`` (numpy, protobuf,
    the pipelines: about half a second) in a process of its own, on another core, while this one goes on
    with its own imports and start-up; the first worker forked waits only for what is left of it."""
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()


class WorkerDied(Exception):
    """The worker process running the task exited before answering."""


class TaskTimedOut(WorkerDied):
    """The task ran longer than the pool's ``task_timeout_s``; its worker was killed and replaced."""


@dataclass(slots=True)
class _Task:
    number: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    on_abandoned: Callable[[], None] | None = None
    pickled: bytes | None = None  # pickled once, when first considered for sending

    def settle(self, ok: bool, value: Any) -> None:
        if self.future.cancelled():
            if self.on_abandoned is not None:
                self.on_abandoned()
        elif ok:
            self.future.set_result(value)
        else:
            self.future.set_exception(value)


@dataclass(slots=True)
class _Worker:
    process: BaseProcess
    conn: multiprocessing.connection.Connection
    fd: int
    tasks: deque[_Task] = field(default_factory=deque)  # written to it, in order; the first is running
    alive: bool = True
    running_since: float = 0.0  # when tasks[0] was written or became first (monotonic)
    killed_after_s: float = 0.0  # > 0: killed because tasks[0] ran this long


def serve(conn: multiprocessing.connection.Connection, initializer: Callable[[], None] | None) -> None:
    """A worker's main loop: (number, fn, args) in, (number, ok, result or exception) out, until EOF."""
    if initializer is not None:
        initializer()
    while True:
        try:
            number, fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[int, bool, Any] = (number, True, fn(*args))
        except Exception as exc:  # noqa: BLE001  (handed to the caller; the worker takes the next task)
            answer = (number, False, exc)
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return
        except Exception as exc:  # noqa: BLE001  (an unpicklable result or error: the caller is told)
            conn.send(
                (number, False, RuntimeError(f"task result could not be sent: {type(exc).__name__}: {exc}"))
            )


class WorkerPool:
    """``workers`` processes, each running one task with at most one more waiting in its pipe; tasks
    beyond that are queued here, in order."""

    def __init__(
        self,
        workers: int,
        context: ProcessContext,
        *,
        initializer: Callable[[], None] | None = None,
        on_restart: Callable[[], None] | None = None,
        task_timeout_s: float = 0.0,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        """``task_timeout_s``: a task running longer gets its worker killed (0 = never)."""
        self.size = workers
        self._context = context
        self._initializer = initializer
        self._on_restart = on_restart
        self._workers: list[_Worker] = []
        self._queue: deque[_Task] = deque()
        self._numbers = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.restarts = 0
        self.timeouts = 0
        self.task_timeout_s = task_timeout_s
        self._on_timeout = on_timeout
        self._watchdog: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for _ in range(self.size):
            self._workers.append(self._spawn())
        if self.task_timeout_s > 0:
            self._watch()

    def _watch(self) -> None:
        """Every quarter of the timeout (at most every second): kill the workers whose task overran."""
        assert self._loop is not None
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.alive and worker.killed_after_s and worker.process.exitcode is not None:
                # Killed and gone, yet no end of file on its pipe (a process it started still holds
                # the other end): settle it as dead now.
                self._died(worker)
                continue
            ran = now - worker.running_since
            if worker.alive and worker.tasks and not worker.killed_after_s and ran > self.task_timeout_s:
                worker.killed_after_s = ran
                self.timeouts += 1
                log.error(
                    "CPU task ran too long; killing its worker",
                    pid=worker.process.pid,
                    task=getattr(worker.tasks[0].fn, "__name__", "?"),
                    ran_s=round(ran, 3),
                    timeout_s=self.task_timeout_s,
                )
                if self._on_timeout is not None:
                    self._on_timeout()
                # The task fails when the pipe reports end of file, i.e. once the process is gone.
                worker.process.kill()
        interval = min(1.0, max(0.05, self.task_timeout_s / 4))
        self._watchdog = self._loop.call_later(interval, self._watch)

    def _spawn(self) -> _Worker:
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=serve, args=(theirs, self._initializer), daemon=True, name="hkgw-cpu"
        )
        process.start()
        theirs.close()
        worker = _Worker(process, ours, ours.fileno())
        assert self._loop is not None
        self._loop.add_reader(worker.fd, self._answered, worker)
        # uvloop makes a watched fd non-blocking; Connection needs blocking reads and writes (a message is
        # written and read whole, by two processes that are both at it).
        os.set_blocking(worker.fd, True)
        return worker

    def pids(self) -> list[int]:
        return sorted(w.process.pid for w in self._workers if w.alive and w.process.pid is not None)

    def busy(self) -> int:
        """Workers with a task written to them and not yet answered."""
        return sum(1 for w in self._workers if w.alive and w.tasks)

    def submit(
        self, fn: Callable[..., Any], *args: Any, on_abandoned: Callable[[], None] | None = None
    ) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` in a worker; the future has its result or exception. ``on_abandoned`` is
        called when a task whose future was cancelled is over (the worker ran it anyway)."""
        assert self._loop is not None
        if self._closed:
            raise RuntimeError("worker pool is closed")
        task = _Task(next(self._numbers), fn, args, self._loop.create_future(), on_abandoned)
        self._queue.append(task)
        self._feed()
        return task.future

    def _feed(self) -> None:
        for worker in list(self._workers):  # a worker found dead here is replaced in the list
            while self._queue and worker.alive and len(worker.tasks) < 2:
                task = self._queue[0]
                if task.pickled is None:
                    try:
                        task.pickled = bytes(ForkingPickler.dumps((task.number, task.fn, task.args)))
                    except Exception as exc:  # noqa: BLE001  (unpicklable arguments: that task fails)
                        self._queue.popleft()
                        task.settle(False, exc)
                        continue
                if worker.tasks and len(task.pickled) > QUEUED_TASK_MAX_BYTES:
                    break
                self._queue.popleft()
                if not worker.tasks:
                    worker.running_since = time.monotonic()
                worker.tasks.append(task)
                data, task.pickled = task.pickled, None
                try:
                    worker.conn.send_bytes(data)
                except (OSError, EOFError):
                    self._died(worker)
                    break

    def _answered(self, worker: _Worker) -> None:
        try:
            number, ok, value = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        if worker.tasks and worker.tasks[0].number == number:
            worker.tasks.popleft().settle(ok, value)
            worker.running_since = time.monotonic()  # the next one, already in its pipe, starts now
            # Answered just as it was killed: what follows dies with the process, through no fault of its own.
            worker.killed_after_s = 0.0
        self._feed()

    def _died(self, worker: _Worker) -> None:
        if not worker.alive:
            return
        worker.alive = False
        assert self._loop is not None
        self._loop.remove_reader(worker.fd)
        worker.conn.close()
        worker.process.join(0)
        pid, code = worker.process.pid, worker.process.exitcode
        if worker.tasks:
            running = worker.tasks.popleft()
            if worker.killed_after_s:
                error: WorkerDied = TaskTimedOut(
                    f"CPU task ran {worker.killed_after_s:.1f} s (task_timeout_s {self.task_timeout_s:g}); "
                    f"worker {pid} killed"
                )
            else:
                error = WorkerDied(f"CPU worker {pid} exited ({code})")
            running.settle(False, error)
        # The rest were waiting in its pipe and never started: they go first to the next worker.
        self._queue.extendleft(reversed(worker.tasks))
        worker.tasks.clear()
        self._workers.remove(worker)
        self._feed()
        if self._closed:
            return
        self.restarts += 1
        log.error("CPU worker died; starting another", pid=pid, restarts=self.restarts)
        if self._on_restart is not None:
            self._on_restart()
        self._respawn()

    def _respawn(self) -> None:
        if self._closed:
            return
        try:
            self._workers.append(self._spawn())
        except (OSError, RuntimeError) as exc:  # e.g. out of processes or memory: try again shortly
            log.error(
                "cannot start a CPU worker; retrying in 1 s", error=repr(exc), running=len(self._workers)
            )
            assert self._loop is not None
            self._loop.call_later(1.0, self._respawn)
            return
        self._feed()

    def close(self) -> None:
        """Stop the workers; queued and running tasks fail. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for worker in self._workers:
            if self._loop is not None and worker.alive:
                self._loop.remove_reader(worker.fd)
            worker.alive = False
            worker.conn.close()
            worker.process.terminate()
        for worker in self._workers:
            worker.process.join(1.0)
            while worker.tasks:
                worker.tasks.popleft().settle(False, WorkerDied("CPU stage closed"))
        self._workers.clear()
        while self._queue:
            self._queue.popleft().settle(False, WorkerDied("CPU stage closed"))
