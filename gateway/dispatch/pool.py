"""One backend pool: a bounded priority queue per model, a dynamic batcher with Triton's semantics, and the
call to the backend through the CPU pipeline and the circuit breaker.

Batching follows Triton's dynamic batcher: a batch goes out at once when the queue holds one of the
preferred sizes (the largest that fits) or ``max_batch_size``; otherwise the oldest request waits at most
``max_queue_delay_us`` for company. A queue with a realtime request waits at most
``realtime_queue_delay_us`` instead (0 by default: a realtime request goes out with whatever is queued
with it, never waiting for company). Realtime requests are taken before interactive, interactive before
batch; within a class the agents with requests queued share each batch (gateway/dispatch/lanes.py). The
queue is bounded: :meth:`PoolDispatcher.submit` refuses instead of growing, except that a full queue takes
an agent's requests up to its fair share by pushing out the newest of agents over theirs
(gateway/dispatch/admission.py).
"""

from __future__ import annotations

import asyncio
import re
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

import structlog
from prometheus_client import Gauge

from edgewire import labels, pb
from gateway.config import PoolDispatch
from gateway.dispatch import admission
from gateway.dispatch.breaker import BreakerState, CircuitBreaker
from gateway.dispatch.cpu import CpuStage, CpuTaskFailed
from gateway.dispatch.eager import start_eagerly
from gateway.dispatch.lanes import Counts, Lane, ModelQueue, Rank
from gateway.dispatch.work import LEAST_URGENT, PRIORITY_ORDER, WorkItem
from gateway.ops.metrics import GatewayMetrics
from inference.backends.base import (
    Backend,
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelSpec,
    infer_within,
)
from inference.pipeline.base import Prepared
from inference.pipeline.registry import PADDED_PIPELINES, PipelineDeclarations
from inference.pipeline.text import length_bucket
from routing.types import PoolSignals, Priority

log = structlog.get_logger("gateway.dispatch")

# (item, response fields, serialized outputs): the outputs come from the CPU stage already serialized.
Respond = Callable[[WorkItem, pb.InferResponse, bytes], None]
RespondOk = Callable[[Sequence[WorkItem], Sequence[bytes], str, str, pb.ServerTiming, float], None]
"""(items, their serialized outputs, model, version, the batch's timing, when serving began): a served
batch's OK answers, assembled per group by the caller (Ingest.respond_ok)."""
Reroute = Callable[[WorkItem, str], bool]  # (item, failed pool) -> True when another pool took it
Observe = Callable[[WorkItem, float], None]  # (item, service seconds): feeds routing's latency calibration
Stage = Literal["prepare", "infer", "finish"]
ISOLATED_STATUSES: Final = frozenset({"INVALID_ARGUMENT", "INTERNAL"})
"""Final backend errors that one request of a batch can cause (an input the server refuses, a model run
that fails on it): a batch failing with one is served apart to find that request."""
_DOING: Final[dict[Stage, str]] = {
    "prepare": "preparing",
    "infer": "running the model on",
    "finish": "post-processing",
}
MAX_ERROR_CHARS: Final = 512
_IDLE: Final = (0, 0)  # an empty queue's urgent depths
_Picked = tuple[tuple[str, str, int], ModelQueue, ModelSpec | None, int]  # queue's key, it, spec, to take
_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


def batch_limit(pool_max: int, spec: ModelSpec | None) -> int:
    """Requests per batch for a model: the pool's ``max_batch_size``, cut to the model's own (1 for a model
    that does not batch). The gateway's batching must never make a valid request too large."""
    if spec is None:
        return pool_max
    if spec.max_batch_size <= 0:
        return 1
    return min(pool_max, spec.max_batch_size)


def for_operator(message: str) -> str:
    """An error message as an agent's operator reads it: one line, no Python object reprs, bounded."""
    lines = message.strip().splitlines()
    if not lines or lines[0].startswith("Traceback"):
        return "internal error; the gateway logged it"
    return _OBJECT_REPR.sub("", lines[0])[:MAX_ERROR_CHARS]


@dataclass(slots=True)
class _Failed:
    """A stage failed a batch in a way one of its requests may have caused: its requests are served apart.

    ``answer`` is what a request failing so on its own is answered with; ``singly``: a CPU task hung or
    killed its worker, so each request is retried once on its own (else the batch is split in halves).
    """

    items: list[WorkItem]
    stage: Stage
    error: BaseException
    answer: BackendError
    singly: bool = False


class PoolDispatcher:
    """Queues, batches and serves the requests routed to one pool."""

    def __init__(
        self,
        name: str,
        dispatch: PoolDispatch,
        backend: Backend,
        breaker: CircuitBreaker,
        *,
        max_queue_depth: int,
        concurrency: int,
        metrics: GatewayMetrics,
        cpu: CpuStage,
        respond: Respond,
        respond_ok: RespondOk,
        reroute: Reroute,
        observe: Observe | None = None,
        ewma_alpha: float = 0.2,
        pipelines: PipelineDeclarations | None = None,
        after_realtime: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.name = name
        self.dispatch = dispatch
        self.backend = backend
        self.breaker = breaker
        self.max_queue_depth = max_queue_depth
        self.concurrency = concurrency
        self._metrics = metrics
        self._cpu = cpu
        self._respond = respond
        self._reroute = reroute
        self._observe = observe
        self._respond_ok = respond_ok
        # Sends the answers made so far to the agents of frames marked realtime (Ingest.after_realtime):
        # called once their batches are answered, or, those a pass served on the loop, once it has cut its
        # realtime batches (they go first) or is over: answers to realtime frames leave then, not at the
        # end of the tick; other agents' answers stay for the tick's coalesced flush.
        self._after_realtime = after_realtime
        self._in_pass = False
        self._urgent_agents: set[str] = set()  # whose realtime frames' batches were answered in this pass
        self._alpha = ewma_alpha
        self._pipelines = pipelines or PipelineDeclarations()
        # One queue per (model, version, size group); the size group is 0 unless padding makes it matter.
        self._queues: dict[tuple[str, str, int], ModelQueue] = {}
        self._depth = 0
        # Kept by the lanes: requests queued per agent and per class (realtime first), and how many of each
        # agent's have been served (the batcher's pick between queues: fair queueing, lanes.Counts).
        self._counts = Counts()
        self._held = self._counts.held
        self._by_class = self._counts.by_class
        self._inflight: set[asyncio.Task[None]] = set()
        # The batcher is a callback, not a task: a submit schedules one pass for the end of the current
        # loop tick (so a whole frame is queued before batches are cut), a finished batch another, and a
        # batch waiting for company a timer.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._stopped = False  # stop() was called: nothing new is queued (it would never be served)
        self._pass_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._ewma_item_s = 0.0
        self._signals: PoolSignals | None = None  # the last signals() answer
        self._max_batch = dispatch.max_batch_size if dispatch.batching else 1
        self._preferred = sorted(p for p in dispatch.preferred_batch_sizes if p <= self._max_batch)
        self._delay_s = dispatch.max_queue_delay_us / 1e6 if dispatch.batching else 0.0
        self._realtime_delay_s = min(dispatch.realtime_queue_delay_us / 1e6, self._delay_s)
        # A batch holding realtime requests of urgent frames (marked realtime: WorkItem.urgent) takes other
        # requests only up to the batch size that the CPU stage runs in this process
        # (CpuStage.inline_max_requests): filled to 128 with a flood's requests, a lone realtime request went
        # with them through a worker's round trip for its prepare and for its finish (behind the flood's
        # batches there, ~7 ms each on two cores: 0.3-0.6% of the lone realtime requests of
        # bench/realtime_under_load.py took ~15 ms in the gateway, the rest under 2.5). Realtime requests in
        # frames marked otherwise waited in the backlog as their frames did and batch as before.
        self._realtime_batch = cpu.inline_max_requests
        # And only as far as the others add little to its backend call (``realtime_fill_us`` by the pool's
        # time per request; _realtime_size): filled to 32 with a flood's ranking requests of ~20 rows each,
        # a realtime request beside a flood on a device whose time grows with rows (the null backend's
        # simulated server, 0.2 ms a row) waited ~120 ms for their rows (p50 131 ms in all; alone: 27 ms).
        # With no filling at all, beside the batched load of eight agents on the null backend (its time per
        # request a few us) realtime p99 7 -> 30 ms and the load -14%: there the fill costs nothing.
        self._realtime_fill_s = dispatch.realtime_fill_us / 1e6
        # Such a batch may also go when all ``concurrency`` slots are taken, up to ``realtime_reserve`` more
        # in flight (Envoy's circuit breakers keep limits of their own for high-priority requests so):
        # beside a flood whose batches hold every slot for their backend calls, it waited for one of them to
        # finish (the answers' queue_us p50 / p99 ~7 / 32 ms on the simulated server at 0.2 ms a row).
        self._reserve = dispatch.realtime_reserve
        # Small frames' batches: where a batch too large for the CPU stage to run in this process would hold
        # requests of small frames (WorkItem.small: a lone request, a caller's few) beside larger frames'
        # (a flood's), the two take turns in batches of their own (ModelQueue.take_batch): the small
        # frames' run inline, the larger frames' batch is cut whole. Shared with a flood, a lone request
        # rode each large batch's worker round trips: ~7 ms each way on two cores behind other batches
        # (1.5% of them ~15 ms beside a flood, BENCHMARKS.md 2026-12-06 evening), ~250 ms at p50 where it
        # filled every pool and the worker's queue (bench/realtime_under_load.py --queue-depth 256). One more
        # backend call per such batch; the flood's batches stay full (capping them at 32, as for realtime,
        # cost the flood 5%). By agent, not by frame, it misfired: a load of eight agents' frames of 100,
        # each agent holding a few dozen once its frame was partly served, was cut into small batches.
        # The same where a batch would cost the backend more than ``realtime_fill_us`` by the pool's time
        # per request, whatever its size: on a device whose time grows with rows (the simulated server, 0.2
        # ms a row), a lone interactive request rode a flood's batch of 32 ranking requests of ~20 rows
        # each, ~130 ms of backend call (its answers' infer_us p99 ~150 ms, alone 5 ms).
        self._task_name = f"batch-{name}"
        # This pool's metric children, taken from metrics.child on first use (a series appears when it is
        # first written, as before) and kept here: a batch of one would otherwise pay a lookup each.
        self._labels = (self.name,)  # this pool's metric labels
        self._breaker_gauge: Gauge | None = None  # breaker_state of the backend, once it succeeded
        # Read when scraped, not set on every request.
        metrics.child(metrics.queue_depth, name).set_function(lambda: self._depth)
        metrics.child(metrics.inflight, name).set_function(lambda: len(self._inflight))

    # ------------------------------------------------------------------ signals for routing

    @property
    def depth(self) -> int:
        return self._depth

    def healthy(self, now: float) -> bool:
        return (
            self.backend.health() is BackendHealth.SERVING
            and self.breaker.state(now) is not BreakerState.OPEN
        )

    def signals(self, now: float) -> PoolSignals:
        """The pool's state for routing. Every frame asks every pool: the last answer is given again (it is
        immutable) while nothing in it has changed."""
        healthy = self.healthy(now)
        urgent = self._urgent_depth()
        last = self._signals
        if (
            last is None
            or last.queue_depth != self._depth
            or last.urgent_depth != urgent
            or last.ewma_latency_s != self._ewma_item_s
            or last.healthy is not healthy
            or last.concurrency != self.concurrency
        ):
            last = self._signals = PoolSignals(
                queue_depth=self._depth,
                ewma_latency_s=self._ewma_item_s,
                healthy=healthy,
                concurrency=self.concurrency,
                urgent_depth=urgent,
            )
        return last

    def _urgent_depth(self) -> tuple[int, int]:
        """The realtime requests queued, and the realtime and interactive ones (PoolSignals.urgent_depth):
        the batcher cuts the realtime lane first, then the interactive one (``_pick``, ModelQueue.take)."""
        if not self._depth:
            return _IDLE
        by_class = self._by_class
        return by_class[0], by_class[0] + by_class[1]

    def _room(self, agent: str, lane: int) -> int:
        """How many of ``agent``'s requests of priority lane ``lane`` the queue takes now: its fair share
        or the free room and the less urgent lanes' requests, whichever is more
        (gateway/dispatch/admission.py)."""
        fair = self._fair_room(agent, lane)
        if lane >= LEAST_URGENT:
            return fair
        return max(fair, self.max_queue_depth - self._depth + self._lower(lane))

    def _fair_room(self, agent: str, lane: int) -> int:
        """How many of ``agent``'s requests of priority lane ``lane`` the queue takes up to its fair share,
        from others' requests no more urgent than these (admission.room; as ``_push_out`` would take)."""
        return admission.room(
            self._held, agent, self._depth, self.max_queue_depth, lambda: self._held_from(lane)
        )

    def _lower(self, lane: int) -> int:
        """How many requests are queued in the lanes less urgent than ``lane``."""
        return sum(self._by_class[lane + 1 :])

    def pushes_out_for(self, agent: str, lane: int = LEAST_URGENT) -> bool:
        """Whether the queue takes more of ``agent``'s requests of priority lane ``lane`` than it has free
        room for, pushing others out (:meth:`submit_many`)."""
        return self._room(agent, lane) > self.max_queue_depth - self._depth

    def signals_for(self, agent: str, now: float, lane: int = LEAST_URGENT) -> PoolSignals:
        """:meth:`signals` as routing sees them for ``agent``'s requests of priority lane ``lane``: a full
        queue that would push others out for them (:meth:`submit_many`) is as deep as leaves room for
        them."""
        signals = self.signals(now)
        depth = self.max_queue_depth - self._room(agent, lane)
        return signals if depth >= self._depth else replace(signals, queue_depth=depth)

    # ------------------------------------------------------------------ intake

    def submit(self, item: WorkItem, now: float) -> bool:
        """Queue an item; False when the pool's queue is full (the caller answers OVERLOADED) or the pool
        is stopping (a batch failing during drain is not rerouted into a queue nobody serves)."""
        return self.submit_many([item], now)

    def submit_many(self, items: list[WorkItem], now: float) -> bool:
        """Queue a slice of a frame: requests of one frame with one model, version and priority, in frame
        order; all or none (False: the queue has no room for all of them, or the pool is stopping). In a
        full queue they take the place of less urgent requests (:meth:`_preempt`), else they are taken up
        to their agent's fair share, pushing other agents' newest requests out (:meth:`_push_out`)."""
        if self._stopped:
            return False
        first = items[0]
        lane = PRIORITY_ORDER[first.priority]
        over = self._depth + len(items) - self.max_queue_depth
        if over > 0 and not (
            self._preempt(over, lane) or self._push_out(first.agent_id, len(items), over, lane)
        ):
            return False
        request = first.request  # its model and version, without WorkItem's properties (a call each)
        model, version = request.model_name, request.model_version
        padded = self._pads(first)
        for item in items:
            item.enqueued = now
        if not padded:
            self._queue_of((model, version, 0)).lanes[lane].add(items)
        else:  # one slice per length bucket
            buckets: dict[int, list[WorkItem]] = {}
            bucket_of = self._bucket_of
            for item in items:
                buckets.setdefault(bucket_of(item.text_tokens), []).append(item)
            for bucket, part in buckets.items():
                self._queue_of((model, version, bucket)).lanes[lane].add(part)
        self._depth += len(items)
        self._schedule_pass()
        return True

    def _queue_of(self, key: tuple[str, str, int]) -> ModelQueue:
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = ModelQueue(self._counts)
        return queue

    def _push_out(self, agent: str, n: int, need: int, lane: int) -> bool:
        """Make room for ``n`` of ``agent``'s requests of priority lane ``lane``, ``need`` more than the queue
        has free, by answering OVERLOADED the newest requests of the agents over their fair share
        (gateway/dispatch/admission.py) in that lane or less urgent ones: batch first, then interactive,
        then realtime, each lane's newest first (a request whose deadline has passed is answered
        DEADLINE_EXCEEDED instead). False, and nothing done, when the agent's share does not stretch that
        far or the others' requests over their shares are more urgent than these."""
        if self._fair_room(agent, lane) < n:
            return False
        victims = admission.push_out(self._held, agent, need, self.max_queue_depth, self._held_from(lane))
        if victims is None:
            return False
        dropped: list[WorkItem] = []
        for victim, count in victims:
            dropped.extend(self._drop_newest(victim, count, lane))
        self._shed(
            dropped, "pushed_out", "for another agent's requests, as this agent held more than its share"
        )
        return True

    def _preempt(self, need: int, lane: int) -> bool:
        """Make room for requests of priority lane ``lane``, ``need`` more than the queue has free, by
        answering OVERLOADED (or DEADLINE_EXCEEDED) the newest requests of the less urgent lanes, whoever's:
        the least urgent lane first, in it the agents holding the most first (admission.preempt). False, and
        nothing done, when those lanes do not hold that many."""
        if lane >= LEAST_URGENT or self._lower(lane) < need:
            return False
        lanes = range(LEAST_URGENT, lane, -1)
        plan = admission.preempt([self._held_in(lower, lower) for lower in lanes], need)
        if plan is None:  # the counts above say it is not (the lanes' own counts and their agents' agree)
            return False
        dropped: list[WorkItem] = []
        for index, agent, count in plan:
            dropped.extend(self._drop_newest(agent, count, lanes[index], lanes[index]))
        self._shed(dropped, "preempted", "for more urgent requests")
        return True

    def _shed(self, dropped: list[WorkItem], reason: str, why: str) -> None:
        """Answer requests pushed out of the queue: OVERLOADED (``reason``: hkgw_shed_total's), or
        DEADLINE_EXCEEDED where their deadline has passed."""
        live = self._unexpired(dropped, time.monotonic())
        self._metrics.child(self._metrics.shed, self.name, reason).inc(len(live))
        message = f"pool {self.name}'s queue is full: pushed out {why}; resend"
        for item in live:
            self._answer_status(item, "OVERLOADED", message)

    def _held_from(self, lane: int) -> dict[str, int]:
        """Each agent's requests queued in priority lane ``lane`` and the less urgent ones."""
        return self._held_in(lane, LEAST_URGENT)

    def _held_in(self, most_urgent: int, least_urgent: int) -> dict[str, int]:
        """Each agent's requests queued in priority lanes ``most_urgent`` to ``least_urgent``."""
        counts: dict[str, int] = {}
        for queue in self._queues.values():
            for less_urgent in queue.lanes[most_urgent : least_urgent + 1]:
                for agent, queued in less_urgent.queued_by_agent():
                    counts[agent] = counts.get(agent, 0) + queued
        return counts

    def _drop_newest(
        self, agent: str, n: int, most_urgent: int, least_urgent: int = LEAST_URGENT
    ) -> list[WorkItem]:
        """Remove ``n`` of ``agent``'s queued requests from lanes ``most_urgent`` to ``least_urgent``: its
        least urgent lane first; within a lane, the queue with its newest slice first, newest first."""
        dropped: list[WorkItem] = []
        for lane in range(least_urgent, most_urgent - 1, -1):
            holding: list[tuple[float, Lane]] = []  # the agent's newest slice's time in each queue's lane
            for queue in self._queues.values():
                newest = queue.lanes[lane].newest(agent)
                if newest is not None:
                    holding.append((newest, queue.lanes[lane]))
            holding.sort(key=lambda entry: entry[0], reverse=True)
            for _, held_in in holding:
                if len(dropped) >= n:
                    break
                dropped.extend(held_in.drop_newest(agent, n - len(dropped)))
        self._depth -= len(dropped)
        for key in [key for key, queue in self._queues.items() if not queue]:
            del self._queues[key]
        return dropped

    def _pads(self, item: WorkItem) -> bool:
        """Whether the item's model queues per length bucket: a model whose pipeline pads (text).

        Text is padded to the batch's longest sequence; a 3-token query batched with a 120-token
        description is sent as 128 tokens. Requests queue per bucket, so one batch holds one bucket;
        hkgw_padding_waste_ratio shows what is left. Texts of up to ``short_text_tokens`` share the queue of
        that length's bucket (``submit_many``): one backend call for a frame's short queries.
        """
        if not self.dispatch.group_by_size or not item.text_tokens:  # not text: no spec to look up
            return False
        spec = self._spec(item.model, item.version)
        return spec is not None and spec.pipeline in PADDED_PIPELINES

    def _spec(self, model: str, version: str) -> ModelSpec | None:
        """The backend's spec of the model, with the gateway's ``[pipelines.<model>]`` declaration applied."""
        return self._pipelines.apply(self.backend.model(model, version))

    def take_queued(self) -> list[WorkItem]:
        """Remove and return everything still queued (drain hands it back to the agents)."""
        items = [item for queue in self._queues.values() for item in queue.take(len(queue))]
        self._queues.clear()
        self._depth = 0
        return items

    # ------------------------------------------------------------------ lifecycle

    def resize(self, max_queue_depth: int, concurrency: int) -> None:
        """A reload's queue bound and batches in flight (routing's pool entry; both are routing's too, which
        must see the same bound the queue keeps). A smaller bound keeps what is queued (it drains by
        batches); more concurrency starts the batches that can go now."""
        self.max_queue_depth = max_queue_depth
        grown = concurrency > self.concurrency
        self.concurrency = concurrency
        if grown:
            self._schedule_pass()

    def start(self) -> None:
        if not self._running:
            self._loop = asyncio.get_running_loop()
            self._running = True
            self._stopped = False
            self._schedule_pass()

    async def stop(self, timeout_s: float) -> None:
        """Stop batching; wait up to ``timeout_s`` for in-flight calls, then cancel them."""
        self._running = False
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ batcher

    def _ranked(self, *, urgent_only: bool = False) -> list[tuple[Rank, tuple[str, str, int], ModelQueue]]:
        """The queues holding requests, each with its rank (lanes.Rank: class, then the least served agent
        there, then age); ``urgent_only``: those holding realtime requests of urgent frames (what may use
        the realtime reserve)."""
        ranked = []
        for key, queue in self._queues.items():
            if urgent_only and not queue.lanes[0].urgent:
                continue
            rank = queue.rank()
            if rank is not None:
                ranked.append((rank, key, queue))
        return ranked

    def _pick(self, now: float, *, urgent_only: bool = False) -> _Picked | float | None:
        """The queue that ranks first (``_ranked``), with its model's spec and how many to take
        (``_ready_size``); where it waits for company, the first one of its class after it that is ready
        (a queue of a less urgent class does not go before it). None: nothing is queued; a float: how long
        until the first is ready."""
        ranked = self._ranked(urgent_only=urgent_only)
        if not ranked:
            return None
        rank, key, queue = min(ranked) if len(ranked) > 1 else ranked[0]  # keys differ: ranks decide
        spec = self._spec(key[0], key[1])
        size = self._ready_size(queue, now, spec)
        if size:
            return key, queue, spec, size
        wait = self._delay_for(queue) - (now - queue.oldest_enqueued())
        # Ranked by service before age, the first may be a request that came just now, alone: while it waits
        # for company, the others of its class that are ready go (before, the first was always the oldest,
        # and the rest waited its delay with it).
        for other_rank, other_key, other in sorted(ranked):
            if other is queue or other_rank[0] != rank[0]:
                continue
            spec = self._spec(other_key[0], other_key[1])
            size = self._ready_size(other, now, spec)
            if size:
                return other_key, other, spec, size
        return max(wait, 0.0)

    def _ready_size(self, queue: ModelQueue, now: float, spec: ModelSpec | None) -> int:
        """How many to take now; 0 = wait for more (Triton's preferred sizes and max queue delay).
        ``spec``: the queue's model (``_spec``), None when the backend does not serve it.

        A model its server batches itself (Triton ``dynamic_batching``, Ray Serve ``@serve.batch``) goes
        one request per call, at once: batching twice only adds the gateway's delay to the server's.
        """
        if spec is not None and spec.server_batching:
            return 1
        limit = batch_limit(self._max_batch, spec)
        n = len(queue)
        if n >= limit:
            return limit
        fitting = bisect_right(self._preferred, n)  # the preferred sizes are sorted: the largest <= n
        if fitting:
            return self._preferred[fitting - 1]
        if now - queue.oldest_enqueued() >= self._delay_for(queue):
            return n
        return 0

    def _delay_for(self, queue: ModelQueue) -> float:
        """How long the queue's oldest request may wait for company: less when a realtime one is queued."""
        return self._realtime_delay_s if queue.lanes[0].count else self._delay_s

    def _schedule_pass(self) -> None:
        if self._running and not self._pass_scheduled and self._loop is not None:
            self._pass_scheduled = True
            self._loop.call_soon(self._batch_pass)

    def _batch_pass(self) -> None:
        """Cut and start every batch that is ready while a concurrency slot is free; when the first queue
        in line must wait for company, wake up when its delay is over (or at the next submit)."""
        self._pass_scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._in_pass = True
        try:
            self._cut()
        finally:
            self._in_pass = False
            self._send_realtime_answers()

    def _send_realtime_answers(self) -> None:
        if self._urgent_agents:
            agents, self._urgent_agents = self._urgent_agents, set()
            if self._after_realtime is not None:
                self._after_realtime(agents)

    def _cut(self) -> None:
        realtime = False  # realtime batches cut in this pass, their answers not sent yet
        while self._running and len(self._inflight) < self.concurrency + self._reserve:
            reserved = len(self._inflight) >= self.concurrency  # past it: urgent realtime batches only
            now = time.monotonic()
            picked = self._pick(now, urgent_only=reserved)
            if picked is None:
                return
            if isinstance(picked, float):  # the first in line waits for company
                assert self._loop is not None
                self._timer = self._loop.call_later(picked, self._schedule_pass)
                return
            key, queue, spec, size = picked
            if realtime and not queue.lanes[0].count:  # the rest of the pass has no realtime request
                realtime = False
                self._send_realtime_answers()
            realtime = realtime or bool(queue.lanes[0].count)
            first_lane = queue.lanes[0]
            if reserved:  # the realtime ones alone (fill would ride the reserve, their deadlines passed)
                items = queue.take(min(size, first_lane.count))
            elif first_lane.urgent:  # the realtime ones, and others as far as they cost little time
                items = queue.take(self._realtime_size(size, first_lane.count))
            else:
                # small frames' apart (see __init__)
                costly = size * self._ewma_item_s > self._realtime_fill_s
                items = queue.take_batch(size, self._realtime_batch, costly=costly)
            self._depth -= len(items)
            if not queue:
                self._queues.pop(key, None)
            self._start(items, spec, now)

    def _start(self, items: list[WorkItem], spec: ModelSpec | None, now: float) -> None:
        """Start serving a batch just cut (its queue waits observed, the requests whose deadline passed
        answered). Served here: a batch whose every step runs on the loop is answered before this returns;
        one that waits (a worker, a thread, a remote backend) goes on as a task."""
        live = self._expire(items, now)
        if live:
            started = start_eagerly(self._serve(live, spec), name=self._task_name)
            if isinstance(started, asyncio.Task):
                self._inflight.add(started)
                started.add_done_callback(self._finished)
            elif started.error is not None:
                log.error("batch task failed", pool=self.name, exc_info=started.error)

    def serves_at_once(self, items: list[WorkItem]) -> bool:
        """Whether :meth:`serve_at_once` may take ``items`` (a slice of a frame, as for :meth:`submit_many`):
        realtime requests of a frame marked realtime (WorkItem.urgent) that the batcher's next pass would
        cut as one batch, alone, and start first and at once: no realtime request queued in the pool (those
        go first, and the pass cuts realtime queues before any other), nothing queued in the slice's own
        queue (a batch of its model takes realtime requests with others of that queue behind them: fill), a
        concurrency slot free, no wait for company (``realtime_queue_delay_us`` 0), no pass running; more
        than one only where they fit one batch (:meth:`_one_batch`). Less urgent requests of other models
        or length buckets queued in the pool do not keep it from going: the pass would cut it before
        them."""
        item = items[0]
        return (
            item.urgent
            and item.priority is Priority.REALTIME
            and not self._by_class[0]
            and (not self._depth or not self._queues.get(self._key(item)))
            and self._running
            and not self._stopped
            and not self._in_pass
            and not self._realtime_delay_s
            and len(self._inflight) < self.concurrency
            and (len(items) == 1 or self._one_batch(items))
        )

    def _key(self, item: WorkItem) -> tuple[str, str, int]:
        """The queue an item goes to (:meth:`submit_many`): its model, version and, for a model whose
        pipeline pads, its length bucket."""
        request = item.request
        bucket = self._bucket_of(item.text_tokens) if self._pads(item) else 0
        return request.model_name, request.model_version, bucket

    def _bucket_of(self, text_tokens: int) -> int:
        """The length bucket a padded model's request queues in: its own, or that of ``short_text_tokens``
        for a text up to that long (they share one queue)."""
        return length_bucket(max(text_tokens, self.dispatch.short_text_tokens))

    def _one_batch(self, items: list[WorkItem]) -> bool:
        """Whether the pass would cut these requests (one slice, queued alone) as one batch: no more than
        the model takes, a model its server does not batch itself (one request per call), one length
        bucket where the model's queues are per bucket (submit_many)."""
        first = items[0]
        spec = self._spec(first.request.model_name, first.request.model_version)
        if spec is None or spec.server_batching or len(items) > batch_limit(self._max_batch, spec):
            return False
        if not self._pads(first):
            return True
        bucket_of = self._bucket_of
        bucket = bucket_of(first.text_tokens)
        return all(bucket_of(item.text_tokens) == bucket for item in items)

    def serve_at_once(self, items: list[WorkItem]) -> None:
        """Serve ``items`` (:meth:`serves_at_once` said so) as the batcher's pass would, without queueing
        them: the same batch, counted alike (its agent's requests served: lanes.Counts; its queue wait, 0),
        its answers sent once it is served (``after_realtime``). A lone realtime request so skips its queue,
        the pass's call and its pick: ~40 us of ~400 (bench.lone_profile --at-once-turns)."""
        now = time.monotonic()
        for item in items:
            item.enqueued = now
        first = items[0]
        self._counts.served_at_once(first.agent_id, len(items))
        request = first.request
        self._in_pass = True
        try:
            self._start(items, self._spec(request.model_name, request.model_version), now)
        finally:
            self._in_pass = False
            self._send_realtime_answers()

    def _realtime_size(self, size: int, realtime: int) -> int:
        """How many to take (of ``size`` ready) for a batch led by ``realtime`` realtime requests of urgent
        frames: them, and less urgent ones only up to ``realtime_fill_us`` of the backend's time by the
        pool's time per request so far (none while it has none), in all at most what the CPU stage runs
        in this process (``cpu.inline_max_requests``; more realtime requests than that all the same)."""
        own = min(size, realtime)
        per_item = self._ewma_item_s
        if per_item <= 0.0 or own >= self._realtime_batch:
            return own
        others = int(self._realtime_fill_s / per_item)
        return min(size, own + min(others, self._realtime_batch - own))

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._schedule_pass()
        if not task.cancelled() and task.exception() is not None:
            log.error("batch task failed", pool=self.name, exc_info=task.exception())

    def _expire(self, items: list[WorkItem], now: float) -> list[WorkItem]:
        """A batch just cut: its queue waits observed, the requests whose deadline passed answered
        (:meth:`_unexpired`), in one pass over it; the others."""
        tally, waited, labels = self._metrics.tally, self._metrics.queue_wait, self._labels
        enqueued: dict[float, int] = {}  # a frame's slice was queued at one time: one observation per slice
        expired = False
        for item in items:
            enqueued[item.enqueued] = enqueued.get(item.enqueued, 0) + 1
            deadline = item.deadline
            if deadline is not None and deadline <= now:
                expired = True
        for at, n in enqueued.items():
            tally.observe(waited, labels, now - at, n)
        return self._unexpired(items, now) if expired else items

    def _unexpired(self, items: list[WorkItem], now: float) -> list[WorkItem]:
        """The items whose deadline has not passed; the others are answered DEADLINE_EXCEEDED."""
        live = []
        for item in items:
            if item.deadline is not None and item.deadline <= now:
                self._metrics.child(self._metrics.shed, self.name, "deadline").inc()
                self._answer_status(item, "DEADLINE_EXCEEDED", "deadline passed in queue")
            else:
                live.append(item)
        return live

    # ------------------------------------------------------------------ serving one batch

    async def _serve(self, items: list[WorkItem], spec: ModelSpec | None = None) -> None:
        """Serve a batch cut by the batcher (``spec``: its model's, as the batcher found it; None: look it
        up), and apart the requests that one of them may have failed; every request is answered."""
        try:
            failed = await self._attempt(items, retried=False, spec=spec)
            if failed is not None:
                await self._apart(failed)
        except asyncio.CancelledError:
            # Cancelled at the drain deadline (or on close) before it answered: accepted work is never
            # dropped silently; the agents resend these elsewhere.
            for item in items:
                self._answer_status(item, "UNAVAILABLE", "gateway stopping: resend")
            raise
        except Exception:  # a bug in a pipeline or a backend adapter: answer, never leave requests hanging
            log.exception("batch failed", pool=self.name)
            for item in items:
                self._answer_status(item, "INTERNAL", "internal error while serving the batch")
        # A batch's realtime requests lead it (that lane is cut first); its urgent frames' agents are sent to.
        if items[0].priority is Priority.REALTIME:
            agents = self._urgent_agents
            for item in items:
                if item.urgent:
                    agents.add(item.agent_id)
            if not self._in_pass:  # finished in a task of its own (a worker, a remote backend): now
                self._send_realtime_answers()

    async def _attempt(
        self, items: list[WorkItem], *, retried: bool, spec: ModelSpec | None = None
    ) -> _Failed | None:
        """Serve one batch: prepare, backend call, finish, answers. Returns what failed it when one of its
        requests may be the cause (the caller serves them apart); every other outcome is answered here.
        ``retried``: the requests are a retry of a batch whose CPU task hung or died (they run in worker
        processes and are not retried again). ``spec``: the model's, when the caller has just looked it up.
        """
        now = time.monotonic()
        first = items[0]
        request = first.request  # its model and version, without WorkItem's properties (a call each)
        model, version = request.model_name, request.model_version
        if spec is None:
            spec = self._spec(model, version)
        if spec is None:
            for item in items:
                self._answer_status(item, "MODEL_NOT_FOUND", f"{self.name} does not serve it")
            return None
        if not self.breaker.allow(now):
            self._fail(items, BackendError("circuit breaker open", retryable=True, status="UNAVAILABLE"))
            return None
        requests = [item.request for item in items]
        raw = [item.raw for item in items if item.raw is not None]
        payloads = raw if len(raw) == len(items) else None
        t_pre = time.perf_counter()
        try:
            prepared = await self._cpu.prepare(
                spec.pipeline, spec, requests, in_worker=retried, payloads=payloads
            )
        except Exception as exc:  # noqa: BLE001  (answered: by _cpu_failed, or apart)
            return self._cpu_failed(items, "prepare", exc, retried)
        t_infer = time.perf_counter()
        try:
            outcome = await self._call_backend(items, prepared, spec, t_infer)
        finally:
            self._cpu.release(prepared)
        if outcome is None or isinstance(outcome, _Failed):
            return outcome
        result, kept, t_post = outcome
        try:
            outputs = await self._cpu.finish(
                spec.pipeline,
                prepared,
                result.outputs,
                # Only where finish runs depends on them (their number and size): all of them, in any order,
                # is the batch's own list.
                requests if len(prepared.kept) == len(requests) else [requests[i] for i in prepared.kept],
                in_worker=retried,
            )
        except Exception as exc:  # noqa: BLE001  (answered: by _cpu_failed, or apart)
            return self._cpu_failed(kept, "finish", exc, retried)
        timing = pb.ServerTiming(
            preprocess_us=int((t_infer - t_pre) * 1e6),
            infer_us=int((t_post - t_infer) * 1e6),
            postprocess_us=int((time.perf_counter() - t_post) * 1e6),
        )
        self._answer(kept, outputs, model, result.model_version, timing, started=now)
        return None

    def _cpu_failed(
        self, items: list[WorkItem], stage: Stage, exc: Exception, retried: bool
    ) -> _Failed | None:
        """The CPU stage raised ``exc`` for a batch: a hung or dead task (its requests retried one by one,
        once), a pipeline raising on some input (served apart), or the stage closing (answered)."""
        if isinstance(exc, CpuTaskFailed):
            if retried or len(items) == 1:
                self._fail(items, exc)
                return None
            return _Failed(items, stage, exc, exc, singly=True)
        if isinstance(exc, BackendError):  # the CPU stage is closed: nothing to do with the requests
            self._fail(items, exc)
            return None
        answer = BackendError(
            f"internal error while {_DOING[stage]} this request; the gateway logged it",
            retryable=False,
            status="INTERNAL",
        )
        return _Failed(items, stage, exc, answer)

    async def _apart(self, failed: _Failed) -> None:
        """Serve apart the requests of a batch that one of them may have failed, so that it fails alone.

        A CPU task that hung or killed its worker: every request once more on its own, in worker processes,
        ``cpu.workers`` at a time (the one that hung hangs again, is killed again and fails alone; the rest
        are served). Any other such failure: the batch is split in halves, both halves are served, and the
        halves that fail again are split in turn, down to single requests, each answered with the error
        it fails with alone. Halves are served breadth first, so a half that succeeds comes between two that
        fail: the breaker (consecutive failures) is not opened by one bad request, and opens as before for
        a backend that fails everything. At most 2n - 1 attempts for n requests; each split is counted in
        ``hkgw_batch_isolations_total{how="split"}``, each retry one by one as ``how="singly"``.
        """
        if len(failed.items) == 1:
            self._failed_alone(failed, first=True)
            return
        log.error(
            "batch failed; serving its requests apart",
            pool=self.name,
            stage=failed.stage,
            requests=len(failed.items),
            how="singly" if failed.singly else "split",
            exc_info=failed.error,
        )
        pending = [failed]
        while pending:
            again: list[_Failed] = []
            for part in pending:
                if part.singly:  # a CPU task hung or died: no more splits, one by one
                    self._metrics.child(self._metrics.batch_isolations, self.name, part.stage, "singly").inc()
                    await self._one_by_one(part.items)
                    continue
                if len(part.items) == 1:
                    self._failed_alone(part)
                    continue
                self._metrics.child(self._metrics.batch_isolations, self.name, part.stage, "split").inc()
                middle = len(part.items) // 2
                for half in (part.items[:middle], part.items[middle:]):
                    live = self._unexpired(half, time.monotonic())
                    outcome = await self._attempt(live, retried=False) if live else None
                    if outcome is not None:
                        again.append(outcome)
            pending = again

    async def _one_by_one(self, items: list[WorkItem]) -> None:
        """Serve each item as a batch of its own, once, in worker processes, ``cpu.workers`` at a time."""
        slots = asyncio.Semaphore(max(1, self._cpu.workers))

        async def alone(item: WorkItem) -> None:
            async with slots:
                if self._unexpired([item], time.monotonic()):
                    outcome = await self._attempt([item], retried=True)
                    if outcome is not None:
                        self._failed_alone(outcome)

        results = await asyncio.gather(*(alone(item) for item in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    def _failed_alone(self, failed: _Failed, *, first: bool = False) -> None:
        """A request that failed a batch of its own: answered with its stage's error (or rerouted).
        ``first``: it was alone from the start (its traceback is logged here, not with a batch's)."""
        item = failed.items[0]
        log.warning(
            "request failed alone",
            pool=self.name,
            stage=failed.stage,
            model=item.model,
            agent=item.agent_id,
            error=f"{type(failed.error).__name__}: {failed.error}",
            exc_info=failed.error if first else None,
        )
        self._fail(failed.items, failed.answer)

    async def _call_backend(
        self, items: list[WorkItem], prepared: Prepared, spec: ModelSpec, t_infer: float
    ) -> tuple[InferResult, list[WorkItem], float] | _Failed | None:
        """The backend call for a prepared batch (started at ``t_infer``): (result, the requests it served,
        when it returned); what failed it when one request may be the cause; or None when every request
        was answered otherwise (rejected inputs, a failed call)."""
        first = items[0]
        self._reject_inputs(items, prepared, spec)
        if not prepared.kept:
            return None
        kept = items if len(prepared.kept) == len(items) else [items[i] for i in prepared.kept]
        priority = min({item.priority for item in kept}, key=PRIORITY_ORDER.__getitem__)
        deadlines = [item.deadline for item in kept if item.deadline is not None]
        deadline = min(deadlines) if deadlines else None
        call = InferCall(
            model=first.request.model_name,
            version=first.request.model_version,
            inputs=prepared.inputs,
            priority=priority,
            # The most urgent request's time left: min(d) - now is min(d - now), exactly (rounding keeps
            # the order).
            timeout_s=None if deadline is None else deadline - time.monotonic(),
        )
        self._metrics.tally.observe(self._metrics.batch_size, self._labels, len(kept))
        try:
            result = await infer_within(self.backend, call, spec.max_batch_size)
        except BackendError as exc:
            self._account_failure(exc, time.perf_counter() - t_infer)
            if _isolable(exc):
                return _Failed(kept, "infer", exc, exc)
            self._fail(kept, exc)
            return None
        except Exception as exc:  # noqa: BLE001  (a backend bug must not take the pool down: counted, apart)
            self._account_failure(
                BackendError(type(exc).__name__, retryable=True), time.perf_counter() - t_infer
            )
            answer = BackendError(
                f"internal error in backend {self.backend.name}; the gateway logged it",
                retryable=True,
                status="INTERNAL",
            )
            return _Failed(kept, "infer", exc, answer)
        t_post = time.perf_counter()
        self._succeeded(t_post - t_infer, kept)
        return result, kept, t_post

    def _succeeded(self, infer_s: float, kept: list[WorkItem]) -> None:
        """A backend call that served ``kept`` in ``infer_s``: breaker, metrics, latency estimates."""
        metrics, backend = self._metrics, self.backend.name
        gauge = self._breaker_gauge
        if self.breaker.success() or gauge is None:
            # Closed by this success (or the pool's first). A breaker that was closed already has its gauge
            # at CLOSED: every failure sets it to the breaker's state after it, and only a success closes it.
            gauge = self._breaker_gauge = metrics.child(metrics.breaker_state, backend)
            gauge.set(BreakerState.CLOSED)
        metrics.tally.inc(metrics.backend_calls, (backend, "ok"))
        metrics.tally.observe(metrics.backend_latency, (backend,), infer_s)
        per_item = infer_s / len(kept)
        alpha = self._alpha
        self._ewma_item_s = (
            per_item if not self._ewma_item_s else alpha * per_item + (1 - alpha) * self._ewma_item_s
        )
        observe = self._observe
        if observe is None:
            return
        seen: set[int] = set()
        for item in kept:  # one observation per size bucket: the batch's time is each one's service time
            if item.decision.size_bucket not in seen:
                seen.add(item.decision.size_bucket)
                observe(item, infer_s)

    def _answer(
        self,
        items: Sequence[WorkItem],
        outputs: Sequence[bytes],
        model: str,
        version: str,
        timing: pb.ServerTiming,
        started: float,
    ) -> None:
        now = time.monotonic()
        deadlines = [deadline for item in items if (deadline := item.deadline) is not None]
        if not deadlines or min(deadlines) >= now:  # none late (most batches): answered as they are
            self._respond_ok(items, outputs, model, version, timing, started)
            return
        on_time: list[WorkItem] = []
        kept: list[bytes] = []
        for item, output_bytes in zip(items, outputs, strict=True):
            if item.deadline is not None and item.deadline < now:
                # A late answer is no answer: the caller has given up on it.
                self._metrics.child(self._metrics.shed, self.name, "late").inc()
                self._answer_status(item, "DEADLINE_EXCEEDED", "deadline passed during inference")
                continue
            on_time.append(item)
            kept.append(output_bytes)
        self._respond_ok(on_time, kept, model, version, timing, started)

    def _reject_inputs(self, items: Sequence[WorkItem], prepared: Prepared, spec: ModelSpec) -> None:
        if prepared.padded_elements:
            waste = 1.0 - prepared.real_elements / prepared.padded_elements
            metrics = self._metrics
            metrics.tally.observe(metrics.padding_waste, (metrics.model_label(spec.name),), waste)
        if prepared.truncated:
            self._metrics.child(self._metrics.input_truncated, self._metrics.model_label(spec.name)).inc(
                prepared.truncated
            )
        for index, (label, detail) in prepared.rejected.items():
            self._metrics.child(
                self._metrics.input_rejected, self._metrics.model_label(spec.name), label
            ).inc()
            self._answer_status(items[index], "INVALID_ARGUMENT", f"{label}: {detail}")

    def _account_failure(self, exc: BackendError, elapsed_s: float) -> None:
        outcome = "overloaded" if exc.overloaded else exc.status.lower()
        self._metrics.child(self._metrics.backend_calls, self.backend.name, outcome).inc()
        self._metrics.child(self._metrics.backend_latency, self.backend.name).observe(elapsed_s)
        if not exc.overloaded and exc.status not in (
            "DEADLINE_EXCEEDED",
            "INVALID_ARGUMENT",
            "MODEL_NOT_FOUND",
        ):
            now = time.monotonic()
            self.breaker.failure(now)
            self._metrics.child(self._metrics.breaker_state, self.backend.name).set(self.breaker.state(now))

    def _fail(self, items: Sequence[WorkItem], exc: BackendError) -> None:
        """Retry each item once on another pool when the error allows it, else answer with the error."""
        for item in items:
            item.attempts += 1
            if (exc.retryable or exc.overloaded) and item.attempts <= 1 and self._reroute(item, self.name):
                continue
            status = "OVERLOADED" if exc.overloaded else exc.status
            if exc.overloaded:
                self._metrics.child(self._metrics.shed, self.name, "backend_overloaded").inc()
            self._answer_status(item, status, str(exc))

    def _answer_status(self, item: WorkItem, status: str, message: str) -> None:
        self._respond(item, self._status(item, status, message), b"")

    def _status(self, item: WorkItem, status: str, message: str) -> pb.InferResponse:
        return pb.InferResponse(
            request_id=item.request.request_id,
            status=labels.STATUS_BY_LABEL.get(status.lower(), pb.STATUS_INTERNAL),
            error_message=for_operator(message),
            model_name=item.model,
        )


def _isolable(exc: BackendError) -> bool:
    """A backend error one request of the batch may have caused (see ``ISOLATED_STATUSES``)."""
    return not exc.retryable and not exc.overloaded and exc.status in ISOLATED_STATUSES
