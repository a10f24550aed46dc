"""What happens to a frame once a carrier has read it: decode -> authenticate -> dedupe -> route -> queue,
and the acknowledgement that tells the agent which requests the gateway now owns.

Everything here runs on the event loop without awaiting; the expensive parts (the CPU pipeline and the
backend call) happen later in the pool dispatchers, and a large zstd payload is decompressed on the
inflater's thread first (gateway/ingress/inflate.py), its frame taken here when it is back.
"""

from __future__ import annotations

import functools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import structlog
import zmq
from google.protobuf.message import Message

from edgewire import FrameCodec, FrameError, is_valid_id, labels, now_unix_us, pb
from edgewire.codec import Buffer
from gateway.capture.recorder import CaptureRecorder
from gateway.config import GatewayConfig
from gateway.dedupe import DedupeWindow, RequestState, ResponseCache
from gateway.dispatch.pool import PoolDispatcher
from gateway.dispatch.work import LEAST_URGENT, PRIORITY_ORDER, SMALL_FRAME, WorkItem
from gateway.frames.answers import TIER_WIRE, ResponseHeads
from gateway.frames.groups import Screened
from gateway.frames.route import Routed, route_frame
from gateway.frames.wire import request_spans
from gateway.ingress.auth import AgentAuthenticator, AgentDirectory
from gateway.ingress.backlog import Backlog
from gateway.ingress.budget import (
    BUDGETED_KINDS,
    OVER_BUDGET,
    AgentBudgets,
    HeldConnections,
    HeldReadPace,
    over_budget_ack,
)
from gateway.ingress.carrier import Carrier
from gateway.ingress.inflate import OffLoopInflater
from gateway.ingress.reader import READ_BUDGET_S
from gateway.ops.metrics import GatewayMetrics
from gateway.replies import ReplyRouter
from inference.profile import PRIORITY_OF_WIRE, profile_of
from routing.geo import RegionResolver
from routing.holder import PolicyHolder
from routing.types import Decision, PoolSignals, Priority, Reason, Tier

log = structlog.get_logger("gateway.ingest")
_BEFORE_ENVELOPE = frozenset(
    {pb.REJECT_REASON_WRONG_FRAME_COUNT, pb.REJECT_REASON_HEADER_TOO_LARGE, pb.REJECT_REASON_HEADER_INVALID}
)
"""Refusals at steps 1-3 of PROTOCOL.md section 7: there is no envelope to answer by. Frame 0 is not read
as one even when it would parse: with a frame too many it may not be the envelope at all (a REQ-style
delimiter), and over ``max_header_bytes`` it is not parsed, which is what that limit is for."""

KIND_LABELS = labels.MESSAGE_KIND
STATUS_LABELS = labels.STATUS
NACK_LABELS = labels.NACK
# How a routing rejection is told to the agent.
_REJECT_NACKS: dict[Reason, pb.NackReason.ValueType] = {
    Reason.REJECT_OVERLOADED: pb.NACK_REASON_OVERLOADED,
    Reason.REJECT_UNAVAILABLE: pb.NACK_REASON_OVERLOADED,
    Reason.REJECT_DEADLINE: pb.NACK_REASON_DEADLINE_EXPIRED,
    Reason.REJECT_NO_MODEL: pb.NACK_REASON_UNKNOWN_MODEL,
    Reason.REJECT_NO_POOL: pb.NACK_REASON_INVALID_REQUEST,
}
RETRYABLE_NACKS = frozenset({pb.NACK_REASON_OVERLOADED, pb.NACK_REASON_DRAINING})
MAX_ASKED_ON = 1 << 20
"""Accepted requests whose carrier is remembered for their answer (about 150 bytes each); beyond it the
oldest go, and their answers take the carrier of the first copy (``WorkItem.carrier``)."""
FRAME_WORK_BYTES = 4096
"""What a frame costs to serve on its own (envelope, Ack, its batches' fixed steps), counted as that many
bytes of requests, for the backlog's sharing between agents (gateway/ingress/backlog.py): a frame's work is
the larger of its bytes and its declared decompressed length, plus this."""


class LogSampler:
    """At most one log line per key per interval: a flood of bad frames must not become a flood of logs.

    The metrics count every one; the log shows what they look like.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None to stay quiet; else the number of lines suppressed since the last one."""
        if now - self._last.get(key, float("-inf")) < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)


@dataclass(slots=True)
class _Frame:
    carrier: Carrier
    routing_id: bytes
    envelope: pb.Envelope
    agent_id: str
    region: str
    read_at: float  # when the reader took it (the ingest clock): its requests' receipt, backlog wait included


class _LiveSignals(Mapping[str, PoolSignals]):
    """Every pool's signals at one moment, each read when routing first asks for it: a lone request's
    decision reads only the pools its plan names. Routing is done before anything is queued, so a pool
    read later in the frame's routing reads what it would have read first. With ``agent``: as that agent's
    requests of priority lane ``lane`` may have them, a full queue taking them in the place of less urgent
    requests or up to the agent's fair share (PoolDispatcher.signals_for)."""

    __slots__ = ("_agent", "_lane", "_now", "_pools", "_read")

    def __init__(
        self,
        pools: Mapping[str, PoolDispatcher],
        now: float,
        agent: str | None = None,
        lane: int = LEAST_URGENT,
    ) -> None:
        self._pools = pools
        self._now = now
        self._agent = agent
        self._lane = lane
        self._read: dict[str, PoolSignals] = {}

    def __getitem__(self, name: str) -> PoolSignals:
        found = self._read.get(name)
        if found is None:
            pool = self._pools[name]
            agent = self._agent
            if agent is None:
                found = pool.signals(self._now)
            else:
                found = pool.signals_for(agent, self._now, self._lane)
            self._read[name] = found
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)


class Ingest:
    """The gateway's per-frame logic, shared by all carriers."""

    def __init__(
        self,
        config: GatewayConfig,
        codec: FrameCodec,
        policy: PolicyHolder,
        pools: Mapping[str, PoolDispatcher],
        replies: ReplyRouter,
        metrics: GatewayMetrics,
        regions: RegionResolver,
        authenticator: AgentAuthenticator | AgentDirectory | None,
        clock: Callable[[], float] = time.monotonic,
        capture: CaptureRecorder | None = None,
    ) -> None:
        self._config = config
        self._codec = codec
        self._policy = policy
        self._pools = pools
        self._replies = replies
        self._metrics = metrics
        self.regions = regions
        self._auth = authenticator
        self._clock = clock
        self._capture = capture
        self.dedupe = DedupeWindow(config.dedupe.window_s, config.dedupe.max_entries)
        self.responses = ResponseCache(config.dedupe.response_cache_bytes)
        # Accepted, unanswered: request id -> (the carrier its answer goes on, the agent's sent_at of the
        # frame that asked for it there).
        self._asked_on: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        self.draining = False
        self.epoch = time.time_ns()  # a new value each time the process starts
        self._retry_after_ms = config.replies.retry_after_ms
        self._reject_log = LogSampler(interval_s=1.0)
        self.budgets = AgentBudgets(config.budget, clock)  # each agent's decompressed bytes and decode time
        limits = config.limits
        self.inflater = OffLoopInflater(
            codec, limits.inflate_off_loop_bytes, limits.inflate_off_loop_max_pending
        )
        self._closed = False
        self.held = HeldConnections()  # connections of agents past their told refusals in a hold
        self._held_pace = HeldReadPace(config.budget.held_reads_per_s)  # how fast their frames are read
        self.backlog: Backlog[tuple[_Frame, memoryview]] = Backlog(
            self._serve,
            lambda read, exc: self._frame_failed(read[0], exc),
            limits.backlog_frames,
            limits.backlog_bytes,
            READ_BUDGET_S,
        )
        metrics.dedupe_entries.set_function(lambda: len(self.dedupe))
        metrics.inflate_pending.set_function(lambda: self.inflater.pending)
        metrics.ingest_backlog.set_function(lambda: len(self.backlog))
        metrics.held_connections.set_function(lambda: self.held.held_now(self._clock()))
        # Per-request counts of the frame being handled (cleared as each frame starts), added to the metrics
        # once per frame; keyed by the raw values (model name, enums), made label values once per key.
        self._requests_seen: dict[tuple[str, Priority], int] = {}
        self._decisions_made: Counter[tuple[Tier, str | None, Reason]] = Counter()
        self._evicted_counted = 0

    # ------------------------------------------------------------------ entry point

    def on_message(self, carrier: Carrier, frames: list[zmq.Frame]) -> None:
        """Handle one multipart message from a carrier's ROUTER: [routing id, envelope, payload]."""
        routing_id = frames[0].bytes
        body = [f.buffer for f in frames[1:]]
        metrics = self._metrics
        tally = metrics.tally
        tally.inc(metrics.bytes_received, (carrier.name,), sum(map(len, body)))
        try:
            envelope = self._codec.decode_envelope(body)
        except FrameError as exc:
            if self._capture is not None:
                self._capture.offer(carrier.name, "", "", body)
            self._reject(carrier, routing_id, body[0] if body else b"", exc)
            return
        tally.inc(metrics.frames_received, (carrier.name, KIND_LABELS.get(envelope.kind, "other")))
        if (
            self.held
            and envelope.kind == pb.MESSAGE_KIND_REQUEST_BATCH
            and self._still_held(carrier, routing_id, envelope)
        ):
            return
        agent_id, region = self._identify(frames[1], envelope, carrier, routing_id)
        if self._capture is not None:
            self._capture.offer(carrier.name, agent_id or "", region, body)
        if agent_id is None:
            return
        kind = envelope.kind
        now = self._clock()
        self._replies.seen(agent_id, carrier.name, routing_id, now, sent_us=envelope.sent_at_unix_us)
        if kind not in BUDGETED_KINDS:  # the kinds whose payload the gateway reads; others go no further
            self._reject(
                carrier,
                routing_id,
                body[0],
                FrameError(pb.REJECT_REASON_UNEXPECTED_KIND, KIND_LABELS.get(kind, str(kind))),
            )
            return
        frame = _Frame(carrier, routing_id, envelope, agent_id, region, now)
        payload = body[1]
        if (
            kind == pb.MESSAGE_KIND_REQUEST_BATCH
            and envelope.priority != pb.PRIORITY_CLASS_REALTIME
            and not self.draining
            and self.backlog.offer(
                (frame, payload),
                len(payload),
                agent_id,
                max(len(payload), envelope.uncompressed_length) + FRAME_WORK_BYTES,
            )
        ):
            return  # served in a backlog turn; the reader goes on (gateway/ingress/backlog.py)
        self._serve((frame, payload), now)

    def _serve(self, read: tuple[_Frame, memoryview], now: float | None = None) -> None:
        """Admit, decode and take a frame (``read``: it and its payload) whose envelope and identity have
        passed, as it is read or when its turn in the backlog comes. Its agent's budget is applied here,
        right before the decode, so each frame is admitted against what the agent's frames before it really
        cost; its bytes are charged as it is admitted (the agent's next frames are admitted against them,
        also while this one is in the inflate thread), its decode time when that is done."""
        frame, payload = read
        envelope = frame.envelope
        if self.budgets.enabled:
            now = self._clock() if now is None else now
            if not self._within_budget(frame.carrier, frame.routing_id, envelope, frame.agent_id, now):
                return
        if self.inflater.takes(envelope):
            self._take_off_loop(frame, payload)
            return
        decoded = self._decoded(frame, payload)
        if decoded is not None:
            self._take(frame, *decoded)

    def _frame_failed(self, frame: _Frame, exc: Exception) -> None:
        """Handling a frame outside the carrier's call (a backlog turn, back from the inflate thread) raised:
        counted and logged as a carrier does for the frames it hands over; the next frames go on."""
        self._metrics.ingest_errors.labels(frame.carrier.name).inc()
        log.error("handling a frame failed", carrier=frame.carrier.name, exc_info=exc)

    def _take(self, frame: _Frame, payload: Message, raw: memoryview) -> None:
        """A decoded frame (``raw``: the bytes its payload was parsed from), by kind."""
        if isinstance(payload, pb.RequestBatch):
            self._take_batch(frame, payload, raw)
        elif isinstance(payload, pb.Ping):
            self._answer_ping(frame, payload)
        elif isinstance(payload, pb.DictionaryRequest):
            self._answer_dictionary(frame, payload)

    # ------------------------------------------------------------------ budget

    def _within_budget(
        self, carrier: Carrier, routing_id: bytes, envelope: pb.Envelope, agent_id: str, now: float
    ) -> bool:
        """Whether the agent's budget admits the frame; if it does, the bytes it declares are charged now
        (its decode time is when the decode is done). If not, it is refused before decompression: counted
        and logged as every refusal, a request batch answered with an Ack carrying the retry-after (the first
        :data:`TOLD_PER_HOLD` of a hold; after them its connection is held, :class:`HeldConnections`)."""
        is_batch = envelope.kind == pb.MESSAGE_KIND_REQUEST_BATCH
        inflated = envelope.uncompressed_length if envelope.codec == pb.CODEC_ZSTD else 0
        wait_s = self.budgets.take(agent_id, inflated, now, control=not is_batch)
        if wait_s is None:
            return True
        self._reject(carrier, routing_id, b"", OVER_BUDGET, answer=False)
        if is_batch:
            if self.budgets.tell(agent_id, wait_s, now):
                ack = over_budget_ack(envelope.message_id, wait_s)
                control = self._codec.encode(ack, agent_id=agent_id, region="hk", dict_id=0)
                self._replies.send_control(carrier, routing_id, control)
            elif self._capture is None or not self._capture.active():  # capture sees every frame whole
                ends = self.budgets.hold_ends(agent_id)
                self.held.hold(carrier.name, routing_id, envelope.agent_id, ends, agent_id)
                if ends > now:
                    carrier.hold(routing_id, envelope.agent_id, ends - now)
        return False

    # ------------------------------------------------------------------ held connections

    def _still_held(self, carrier: Carrier, routing_id: bytes, envelope: pb.Envelope) -> bool:
        """Whether this request batch comes on a held connection naming the held agent in its envelope: then
        refused ``over_budget``, unanswered, as the rest of its hold would be, and the carrier's reading
        paced (:class:`HeldReadPace`). On a connection whose hold has ended (lapsed: its agent had ignored
        it), a batch its agent's budget would refuse holds it again until the budget would take it, without
        an Ack (the agent was told, and went on); one it would take goes on, admitted when its turn comes.
        Not while capture is on (it sees every frame whole)."""
        now = self._clock()
        state = self.held.state(carrier.name, routing_id, envelope.agent_id, now)
        if state is None:
            return False
        if self._capture is not None and self._capture.active():
            self.held.release(carrier.name, routing_id)
            return False
        ends, owner = state
        if now >= ends:
            inflated = envelope.uncompressed_length if envelope.codec == pb.CODEC_ZSTD else 0
            wait_s = self.budgets.admit(owner, inflated, now)
            if wait_s is None:
                return False
            ends = now + wait_s
            self.held.hold(carrier.name, routing_id, envelope.agent_id, ends, owner)
        # In a shard, a held frame reaching it means the front does not hold the connection (yet, or any
        # more: a reload or capture there forgot it): told again, it refuses the rest itself.
        carrier.hold(routing_id, envelope.agent_id, ends - now)
        self._reject(carrier, routing_id, b"", OVER_BUDGET, answer=False)  # counted and logged as the others
        self._pace_held(carrier, now)
        return True

    def _pace_held(self, carrier: Carrier, now: float) -> None:
        """The carrier's reader read a frame of a held connection and it was refused: its reading paced. Only
        as it is read: the frames the backlog holds (read before the hold) were read already, and pacing the
        reader for them would hold every other connection's frames back while the backlog is worked off (a
        victim's p99 500 ms behind a full-rate flood at 1,000 a second, bench/budget_attack.py)."""
        pause_s = self._held_pace.take(carrier.name, now)
        if pause_s > 0 and carrier.pause_reading(pause_s):  # in a shard the front paces (shards/holds.py)
            self._metrics.tally.inc(self._metrics.read_pauses, (carrier.name,))

    def release_holds(self) -> None:
        """Forget every held connection (a reload may have revoked or remapped an agent's key: its frames
        must meet the identity checks again, which come before the budget's)."""
        self.held.clear()

    # ------------------------------------------------------------------ identity

    def _identify(
        self, header: zmq.Frame, envelope: pb.Envelope, carrier: Carrier, routing_id: bytes
    ) -> tuple[str | None, str]:
        """The authenticated agent id and its region; the envelope must agree with the key's identity."""
        if self._auth is None:  # plaintext on loopback: the envelope is all there is
            peer = carrier.peer_property(header, "Peer-Address")
            return envelope.agent_id or "anonymous", self.regions.resolve(envelope.region, peer)
        user_id = carrier.peer_property(header, "User-Id")
        identity = self._auth.identity(user_id) if user_id else None
        if identity is None:
            self._reject(
                carrier, routing_id, b"", FrameError(pb.REJECT_REASON_UNKNOWN_AGENT, "no identity"), envelope
            )
            return None, ""
        if envelope.agent_id != identity.agent_id:
            self._reject(
                carrier,
                routing_id,
                b"",
                FrameError(pb.REJECT_REASON_AGENT_MISMATCH, f"envelope says {envelope.agent_id!r}"),
                envelope,
            )
            return None, ""
        return identity.agent_id, self.regions.resolve(identity.region)

    # ------------------------------------------------------------------ control messages

    def _answer_ping(self, frame: _Frame, ping: pb.Ping) -> None:
        limits = self._config.limits
        pong = pb.Pong(
            nonce=ping.nonce,
            ping_sent_at_unix_us=frame.envelope.sent_at_unix_us,
            server_time_unix_us=now_unix_us(),
            dict_ids=self._codec.dictionaries.ids(),
            preferred_dict_id=self._codec.dictionaries.preferred,
            limits=pb.Limits(
                max_frame_bytes=limits.max_frame_bytes,
                max_decompressed_bytes=limits.max_decompressed_bytes,
                max_records=limits.max_records,
            ),
            draining=self.draining,
            gateway_epoch=self.epoch,
        )
        self._send(frame, pong)

    def _answer_dictionary(self, frame: _Frame, request: pb.DictionaryRequest) -> None:
        raw = self._codec.dictionaries.raw(request.dict_id) or b""
        self._send(frame, pb.DictionaryResponse(dict_id=request.dict_id, dictionary=raw))

    def _send(self, frame: _Frame, payload: Message) -> None:
        frames = self._codec.encode(payload, agent_id=frame.agent_id, region="hk", dict_id=0)
        self._replies.send_control(frame.carrier, frame.routing_id, frames)

    def _decoded(
        self, frame: _Frame, body: Buffer | FrameError, *, inflated_s: float | None = None
    ) -> tuple[Message, memoryview] | None:
        """The frame's payload message and the bytes it was parsed from; None when refused (answered).
        ``inflated_s``: ``body`` is the payload inflated already, off the loop, in that many of the inflate
        thread's CPU seconds, or why it was refused there.

        The time decompressing and parsing took is charged to the agent's budget (its bytes were, when the
        frame was admitted), a refusal's too: CPU time, not wall time (a busy host is not the agent's
        doing). Only that: the screening, routing and serving that follow are the gateway's work for the
        requests, not the frame's cost."""
        envelope = frame.envelope
        budgeted = self.budgets.enabled and envelope.kind in BUDGETED_KINDS
        started = time.thread_time() if budgeted else 0.0
        try:
            if isinstance(body, FrameError):
                raise body
            raw = body if inflated_s is not None else self._codec.inflate(envelope, body)
            message = self._codec.parse_payload(envelope, raw)
        except FrameError as exc:
            self._reject(frame.carrier, frame.routing_id, b"", exc, envelope)
            return None
        finally:
            if budgeted:
                spent = time.thread_time() - started + (inflated_s or 0.0)
                self.budgets.charge(frame.agent_id, 0, spent)
        return message, memoryview(raw)

    # ------------------------------------------------------------------ requests

    def _take_off_loop(self, frame: _Frame, body: memoryview) -> None:
        """A large zstd payload (gateway/ingress/inflate.py): decompressed on the inflater's thread while the
        loop goes on, then parsed and taken here as any other; its decode time is charged to the agent when
        it is back (its bytes were, when it was admitted)."""
        metrics = self._metrics
        metrics.tally.inc(metrics.inflated_off_loop, (frame.carrier.name,))
        self.inflater.submit(frame.envelope, body, functools.partial(self._inflated, frame))

    def _inflated(self, frame: _Frame, raw: Buffer | FrameError, inflate_s: float) -> None:
        """A payload back from the inflater (``raw``: its bytes, or why they are refused) after
        ``inflate_s`` of the thread's CPU: parsed, charged, taken. Called by the loop, not a carrier: what
        it raises is counted and logged here, as a carrier does for the frames it hands over."""
        if self._closed:  # closing: nothing to answer on; unacknowledged, the agent sends it again
            log.warning("inflated frame dropped: the gateway is closing", carrier=frame.carrier.name)
            return
        try:
            decoded = self._decoded(frame, raw, inflated_s=inflate_s)
            if decoded is not None:
                self._take(frame, *decoded)
        except Exception as exc:  # noqa: BLE001  (a bug in handling one frame: counted and logged there)
            self._frame_failed(frame, exc)

    def _take_batch(self, frame: _Frame, batch: pb.RequestBatch, payload: memoryview) -> None:
        """A decoded request batch (``payload``: the bytes it was parsed from), per frame: screened request
        by request (ids, duplicates, model, limits, deadline, drain), then routed and queued per group of
        requests routing sees alike (gateway/frames/groups.py), each group one slice of a pool queue; one
        Ack."""
        now = self._clock()
        wall_us = now_unix_us()
        # Counts of this frame only (a frame whose handling raised must not add to the next one's region).
        self._requests_seen.clear()
        self._decisions_made.clear()
        ack = pb.Ack(acked_message_id=frame.envelope.message_id)
        requests = batch.requests
        screened, kept = self._screen_frame(frame, requests, now, wall_us, ack)
        # A small realtime frame's slice that a pool serves at once: after its Ack is held, to go with it.
        at_once: list[tuple[PoolDispatcher, list[WorkItem]]] | None = (
            []
            if len(requests) <= SMALL_FRAME and frame.envelope.priority == pb.PRIORITY_CLASS_REALTIME
            else None
        )
        try:
            if screened:
                # The requests' own bytes, for a CPU stage worker (found in the payload, not serialized
                # again).
                spans = request_spans(payload, requests)
                if spans is not None and len(kept) != len(spans):
                    spans = [spans[index] for index in kept]
                self._route(frame, screened, now, ack, spans, len(requests) <= SMALL_FRAME, at_once)
            self._count_and_acknowledge(frame, ack)
        finally:
            # Served also if counting or acknowledging raised: nothing accepted is left unserved.
            if at_once:
                self._serve_at_once(frame, at_once, now)

    def _serve_at_once(
        self, frame: _Frame, at_once: list[tuple[PoolDispatcher, list[WorkItem]]], now: float
    ) -> None:
        """Serve at once the frame's slice that its pool would serve at once, where it is the only one and
        its pool still would after the frame's other slices were queued (asked again), unless a message
        arrived on the frame's carrier while the frame was handled: otherwise the slices are queued, for
        the batcher's pass to batch them with each other and with what that message brings. Asked last,
        after the frame's handling, so the requests that arrive while one is handled share its batch as
        they did when every realtime request was queued: near saturation (2000 lone requests/s on two
        cores) that sharing is what keeps the loop from falling behind (serving each at once, as read,
        saturated it in 2026-12-05's attempt: docs/GATEWAY.md)."""
        if len(at_once) == 1 and not frame.carrier.more_waiting():
            pool, items = at_once[0]
            if pool.serves_at_once(items):
                pool.serve_at_once(items)
                return
        for pool, items in at_once:
            # Each pool was idle a moment ago and a small frame's requests are few: it takes them (were it
            # not to, they were accepted and are served all the same).
            if not pool.submit_many(items, now):
                pool.serve_at_once(items)

    def _count_and_acknowledge(self, frame: _Frame, ack: pb.Ack) -> None:
        """A frame's requests routed: its counts added to the metrics, its Ack held or sent."""
        metrics = self._metrics
        tally = metrics.tally
        tally.inc(metrics.accepted, (frame.carrier.name,), len(ack.accepted_ids))
        region = metrics.region_label(frame.region)
        # Priority, Tier and Reason are StrEnums: each member is its value's str (as a label, a key, a field)
        for (model, priority), n in self._requests_seen.items():
            tally.inc(metrics.requests, (region, metrics.model_label(model), priority), n)
        for (tier, pool, reason), n in self._decisions_made.items():
            tally.inc(metrics.decisions, (tier, pool or "none", reason), n)
        if self.dedupe.evicted_early != self._evicted_counted:
            metrics.dedupe_evicted.inc(self.dedupe.evicted_early - self._evicted_counted)
            self._evicted_counted = self.dedupe.evicted_early
        if frame.envelope.features & pb.FEATURE_ACKS_IN_RESPONSES and (ack.accepted_ids or ack.duplicate_ids):
            # With the next answers on its connection, or alone after [replies] ack_hold_us (replies.py);
            # a frame refused request by request has nothing coming to wait for.
            self._replies.acknowledge(frame.agent_id, frame.carrier, frame.routing_id, ack)
        else:
            self._send(frame, ack)

    def _route(
        self,
        frame: _Frame,
        screened: Screened,
        now: float,
        ack: pb.Ack,
        spans: list[memoryview] | None,
        small: bool,
        at_once: list[tuple[PoolDispatcher, list[WorkItem]]] | None = None,
    ) -> None:
        """Route the screened requests per group (gateway/frames/route.py) and queue each group as one
        slice of its pool's queue; nack what routing or a full queue refuses. Requests refused only because
        every pool that could serve them is full are routed once more, per priority class (the most urgent
        first), as full queues are for them: one holding less urgent requests takes them in their place,
        and another agent's flood that fills a queue gives up its newest requests to this agent's up to its
        fair share (gateway/dispatch/admission.py). ``small``: the frame holds few requests
        (WorkItem.small; counted before screening: a frame of 100 mostly duplicates is not small).
        ``at_once``: where a slice that a pool would serve at once goes instead of its queue, accepted, for
        the caller to serve (or queue) once the frame's Ack is held (PoolDispatcher.serve_at_once)."""
        policy = self._policy.policy
        routed = route_frame(policy, screened, frame.region, _LiveSignals(self._pools, now))
        full = self._queue_routed(
            frame, screened, routed, now, ack, spans, small, last=False, at_once=at_once
        )
        if not full:
            return
        by_lane: dict[int, list[int]] = {}
        priorities = screened.priorities
        for index in full:
            by_lane.setdefault(PRIORITY_ORDER[priorities[index]], []).append(index)
        for lane in sorted(by_lane):
            indices = by_lane[lane]
            again = screened.subset(indices)
            signals = _LiveSignals(self._pools, now, frame.agent_id, lane)
            routed = route_frame(policy, again, frame.region, signals)
            part = None if spans is None else [spans[i] for i in indices]
            self._queue_routed(frame, again, routed, now, ack, part, small, last=True)

    def _queue_routed(
        self,
        frame: _Frame,
        screened: Screened,
        routed: Routed,
        now: float,
        ack: pb.Ack,
        spans: list[memoryview] | None,
        small: bool,
        *,
        last: bool,
        at_once: list[tuple[PoolDispatcher, list[WorkItem]]] | None = None,
    ) -> list[int]:
        """Queue (or nack) each routed group; unless ``last``, the requests refused because every pool was
        full are left for :meth:`_route` to try again (their indices, in frame order) where some full pool
        would take them in the place of others."""
        full: list[int] = []
        priorities = screened.priorities
        for decision, members in routed:
            if (
                not last
                and decision.reason is Reason.REJECT_OVERLOADED
                and self._makes_room(frame.agent_id, min(PRIORITY_ORDER[priorities[i]] for i in members))
            ):
                full.extend(members)
                continue
            self._decisions_made[(decision.tier, decision.pool, decision.reason)] += len(members)
            if decision.rejected or decision.pool is None:
                nack = _REJECT_NACKS.get(decision.reason, pb.NACK_REASON_OVERLOADED)
                for index in members:
                    self._nack(ack, screened.requests[index].request_id, nack, decision.reason)
                continue
            items = self._items(frame, screened, members, now, decision, spans, small)
            pool = self._pools[decision.pool]
            if at_once is not None and pool.serves_at_once(items):
                self._accepted(frame, items, ack)
                at_once.append((pool, items))
                continue
            if pool.submit_many(items, now):
                self._accepted(frame, items, ack)
                continue
            self._metrics.child(self._metrics.shed, decision.pool, "queue_full").inc(len(items))
            for item in items:
                self._nack(
                    ack,
                    item.request.request_id,
                    pb.NACK_REASON_OVERLOADED,
                    f"pool {decision.pool} queue full",
                )
        return sorted(full)

    def _makes_room(self, agent: str, lane: int) -> bool:
        """Whether some full pool queue would take ``agent``'s requests of priority lane ``lane`` (or less
        urgent) by pushing out others (PoolDispatcher.pushes_out_for)."""
        return any(pool.pushes_out_for(agent, lane) for pool in self._pools.values())

    def _items(
        self,
        frame: _Frame,
        screened: Screened,
        members: list[int],
        now: float,
        decision: Decision,
        spans: list[memoryview] | None,
        small: bool,
    ) -> list[WorkItem]:
        """The work items of the screened requests at ``members``, in frame order, routed by ``decision``;
        received when the frame was read (a wait in the backlog or the inflate thread is the gateway's);
        ``small``: the frame's requests are few (WorkItem.small)."""
        agent, region, carrier, received = frame.agent_id, frame.region, frame.carrier.name, frame.read_at
        urgent = frame.envelope.priority == pb.PRIORITY_CLASS_REALTIME
        requests, priorities, remaining, sizes = (
            screened.requests,
            screened.priorities,
            screened.remaining,
            screened.sizes,
        )
        items = []
        for index in members:
            left = remaining[index]
            items.append(
                WorkItem(
                    requests[index],
                    agent,
                    region,
                    carrier,
                    priorities[index],
                    received,
                    None if left is None else now + left,
                    decision,
                    sizes[index][4],
                    None if spans is None else spans[index],
                    urgent,
                    small,
                )
            )
        return items

    def _accepted(self, frame: _Frame, items: list[WorkItem], ack: pb.Ack) -> None:
        """The gateway owns these requests now: in the dedupe window, their carrier noted (as
        :meth:`_ask_on` notes a first copy), in the Ack."""
        ids = [item.request.request_id for item in items]
        self.dedupe.accept_many(ids, items[0].received)
        asked_on = self._asked_on
        asked_on.update(dict.fromkeys(ids, (frame.carrier.name, frame.envelope.sent_at_unix_us)))
        while len(asked_on) > MAX_ASKED_ON:
            asked_on.popitem(last=False)
        ack.accepted_ids.extend(ids)

    def _screen_frame(
        self, frame: _Frame, requests: Sequence[pb.InferRequest], now: float, wall_us: int, ack: pb.Ack
    ) -> tuple[Screened, list[int]]:
        """Checks that need no routing, request by request in frame order: id, duplicate, model, size,
        deadline, drain. The requests that pass, with what routing reads of each, and their positions in
        the frame; the others are answered in ``ack`` (or, duplicates, from the cache).

        One loop with everything it reads of the gateway taken once: it runs for every request."""
        screened = Screened()
        kept: list[int] = []
        envelope = frame.envelope
        frame_priority, frame_deadline_us = envelope.priority, envelope.deadline_unix_us
        seen = self._requests_seen
        state_of = self.dedupe.state
        models = self._policy.policy.config.models
        max_parameters = self._config.limits.max_parameters
        draining = self.draining
        admit = screened.add
        priority_of = PRIORITY_OF_WIRE.get  # wire_priority, without a call per request
        for index, request in enumerate(requests):
            rid = request.request_id
            model = request.model_name
            priority = priority_of(request.priority or frame_priority, Priority.INTERACTIVE)
            key = (model, priority)
            seen[key] = seen.get(key, 0) + 1
            if not is_valid_id(rid):
                self._nack(ack, rid, pb.NACK_REASON_INVALID_REQUEST, "request_id is not a 16-byte UUIDv7")
                continue
            state = state_of(rid, now)
            if state is not None:
                self._duplicate(frame, request, state, ack)
                continue
            if model not in models:
                self._nack(ack, rid, pb.NACK_REASON_UNKNOWN_MODEL, f"model {model!r}")
                continue
            if len(request.parameters) > max_parameters:
                self._nack(ack, rid, pb.NACK_REASON_INVALID_REQUEST, "too many parameters")
                continue
            deadline_us = request.deadline_unix_us or frame_deadline_us
            remaining = (deadline_us - wall_us) / 1e6 if deadline_us else None
            if remaining is not None and remaining <= 0:
                detail = f"expired {-remaining * 1000:.1f} ms ago"
                self._nack(ack, rid, pb.NACK_REASON_DEADLINE_EXPIRED, detail)
                continue
            if draining:
                self._nack(ack, rid, pb.NACK_REASON_DRAINING, "gateway is draining")
                continue
            admit(request, priority, remaining)
            kept.append(index)
        return screened, kept

    def _duplicate(self, frame: _Frame, request: pb.InferRequest, state: RequestState, ack: pb.Ack) -> None:
        """A resend or a re-ask (the agent lost the carrier its answer was to come on): never run twice. A
        request still running is answered when done on the carrier this frame came on; one answered already
        gets its answer again there, from the cache."""
        rid = request.request_id
        ack.duplicate_ids.append(rid)
        self._metrics.child(self._metrics.duplicates, frame.carrier.name).inc()
        if state is RequestState.DONE:
            self._redeliver(frame, request)
        else:
            self._ask_on(frame, rid, again=True)

    def _count_decision(self, decision: Decision) -> None:
        self._metrics.child(
            self._metrics.decisions, decision.tier.value, decision.pool or "none", decision.reason.value
        ).inc()

    def _nack(self, ack: pb.Ack, rid: bytes, reason: pb.NackReason.ValueType, detail: str) -> None:
        retry = self._retry_after_ms if reason in RETRYABLE_NACKS else 0
        ack.nacks.append(pb.Nack(request_id=rid, reason=reason, retry_after_ms=retry, detail=detail))
        self._metrics.child(self._metrics.nacks, NACK_LABELS[reason]).inc()

    def _ask_on(self, frame: _Frame, rid: bytes, *, again: bool) -> None:
        """The answer to ``rid`` goes on ``frame``'s carrier: the newest frame (by the agent's clock) that
        asked for it. A copy sent earlier and delivered late (by TCP, after a black-hole lifted) does not
        move it back onto the connection the agent has left."""
        sent_us = frame.envelope.sent_at_unix_us
        if again:
            previous = self._asked_on.get(rid)
            if previous is not None and sent_us and sent_us < previous[1]:
                return
        self._asked_on[rid] = (frame.carrier.name, sent_us)
        if len(self._asked_on) > MAX_ASKED_ON:
            self._asked_on.popitem(last=False)

    def _redeliver(self, frame: _Frame, request: pb.InferRequest) -> None:
        """The answer to a request answered already, again: from the cache, or, when the cache no longer
        holds it, an error saying so (running it again could serve it twice; silence would leave the
        agent waiting for its deadline)."""
        cached = self.responses.get(request.request_id)
        if cached is None:
            self._metrics.child(self._metrics.replies_undeliverable, "not_cached").inc()
            cached = pb.InferResponse(
                request_id=request.request_id,
                status=pb.STATUS_INTERNAL,
                error_message="answered already; the answer is no longer in the gateway's response cache",
                model_name=request.model_name,
            ).SerializeToString()
        self._replies.respond(frame.agent_id, cached, frame.carrier.name)

    def reroute(self, item: WorkItem, failed_pool: str) -> bool:
        """Give a request whose pool failed to another pool (spillover with that pool marked unhealthy)."""
        now = self._clock()
        failed_backend = self._pools[failed_pool].backend
        # Every pool on the failed backend is out for this request, so the spillover leaves that backend.
        signals = {
            name: PoolSignals(healthy=False) if pool.backend is failed_backend else pool.signals(now)
            for name, pool in self._pools.items()
        }
        remaining = item.remaining(now)
        if remaining is not None and remaining <= 0:
            return False
        decision = self._policy.policy.decide(
            profile_of(item.request, item.priority, remaining, item.region, item.text_tokens), signals
        )
        self._count_decision(decision)
        if decision.rejected or decision.pool is None or decision.pool == failed_pool:
            return False
        item.decision = decision
        return self._pools[decision.pool].submit(item, now)

    # ------------------------------------------------------------------ responses

    def respond(self, item: WorkItem, response: pb.InferResponse, outputs: bytes = b"") -> None:
        """Finish a request: fill in routing facts and timing, remember it, send it to its agent.

        ``outputs`` is the CPU stage's serialized output fragment; appended to the serialized fields it
        forms the whole response (protobuf merges concatenated messages).
        """
        if item.answered:
            return
        item.answered = True
        decision: Decision = item.decision
        response.tier = TIER_WIRE[decision.tier.value]
        response.pool = decision.pool or ""
        response.route_reason = decision.reason.value
        if not response.model_name:
            response.model_name = item.model
        elapsed = self._clock() - item.received
        response.timing.total_us = int(elapsed * 1e6)
        pool = response.pool or "none"
        metrics = self._metrics
        tier = decision.tier.value
        metrics.tally.inc(metrics.responses, (STATUS_LABELS[response.status], tier, pool))
        metrics.tally.observe(metrics.latency, (tier, pool), elapsed)
        rid = item.request.request_id
        retryable = response.status in (pb.STATUS_OVERLOADED, pb.STATUS_UNAVAILABLE)
        if retryable:
            response.retry_after_ms = self._retry_after_ms
        data = response.SerializeToString() + outputs
        if retryable:
            self.dedupe.forget(rid)  # the agent will resend; that resend must be served
        else:
            self.dedupe.done(rid)
            if self.responses.max_bytes:
                self.responses.put(rid, data)
        asked_on = self._asked_on.pop(rid, (item.carrier, 0))[0]
        self._replies.respond(item.agent_id, data, asked_on)

    def respond_ok(
        self,
        items: Sequence[WorkItem],
        outputs: Sequence[bytes],
        model: str,
        version: str,
        timing: pb.ServerTiming,
        started: float,
    ) -> None:
        """Answer a served batch OK, per group: the requests of one frame and decision share every field
        but their id and outputs, serialized once (gateway/frames/answers.py), and their metrics are
        counted once per group; each answer is its id, the group's fields and its outputs."""
        now = self._clock()
        heads = ResponseHeads(model, version, timing, started, now)
        metrics = self._metrics
        answer, asked_on = heads.answer, self._asked_on
        answered: list[bytes] = []  # ids, in order
        datas: list[bytes] = []
        outbox: dict[tuple[str, str], list[bytes]] = {}
        route: tuple[str, str] | None = None
        answers: list[bytes] = []
        for item, output in zip(items, outputs, strict=True):
            if item.answered:
                continue
            item.answered = True
            rid = item.request.request_id
            data = answer(item, rid, output)
            answered.append(rid)
            datas.append(data)
            asked = asked_on.pop(rid, None)
            here = (item.agent_id, item.carrier if asked is None else asked[0])
            if here != route:  # a batch holds whole slices: consecutive answers mostly go one way
                route = here
                found = outbox.get(here)
                answers = outbox[here] = [] if found is None else found
            answers.append(data)
        self.dedupe.done_many(answered)
        if self.responses.max_bytes:
            self.responses.put_many(answered, datas)
        counts, latencies = heads.totals()
        tally = metrics.tally
        for (tier, pool), n in counts.items():
            tally.inc(metrics.responses, (STATUS_LABELS[pb.STATUS_OK], tier, pool), n)
        for (tier, pool, elapsed), n in latencies.items():
            tally.observe(metrics.latency, (tier, pool), elapsed, n)
        for (agent_id, carrier), batch in outbox.items():
            self._replies.respond_many(agent_id, batch, carrier)

    def after_realtime(self, agents: Collection[str]) -> None:
        """A pool has answered batches of frames marked realtime (all those a pass served, once it has cut
        its realtime batches): send the answers made so far to their ``agents`` now, one frame per agent
        and carrier, not at the end of the loop's tick (ReplyRouter.send_now); other agents' answers stay
        for the tick's flush. Realtime requests in frames marked otherwise waited in the backlog as their
        frames did; their answers go with the tick's, coalesced (a frame of 100 mixed requests from each of
        8 agents sent per batch cost 15% more CPU per record, bench/frame_path.py)."""
        self._replies.send_now(agents)

    def flush_replies(self) -> None:
        """Send every reply ready, Acks still held for answers included (drain)."""
        self._replies.flush(every_ack=True)

    async def settle(self, timeout_s: float) -> bool:
        """Serve every frame waiting in the backlog and take every frame still being inflated off the loop
        (drain: their requests are answered, as draining, before the replies are flushed); False when some
        were not back from the inflate thread within ``timeout_s``."""
        self.backlog.serve_all()
        return await self.inflater.settle(timeout_s)

    def close(self) -> None:
        """Stop the inflater's thread and forget the backlog: a frame it held, or one the thread hands back
        after this, is dropped unacknowledged (its agent sends it again); frames read after this are
        served as they are read."""
        self._closed = True
        self.inflater.close()
        dropped = self.backlog.close()
        if dropped:
            log.warning("frames waiting in the backlog dropped unacknowledged", frames=dropped)

    def hand_back(self, items: list[WorkItem], reason: str) -> None:
        """Answer queued requests UNAVAILABLE (retryable) on drain so the agents send them elsewhere."""
        for item in items:
            self.respond(
                item,
                pb.InferResponse(
                    request_id=item.request.request_id,
                    status=pb.STATUS_UNAVAILABLE,
                    error_message=reason,
                ),
            )

    # ------------------------------------------------------------------ refusals

    def _reject(
        self,
        carrier: Carrier,
        routing_id: bytes,
        header: bytes | memoryview,
        exc: FrameError,
        envelope: pb.Envelope | None = None,
        *,
        answer: bool = True,
    ) -> None:
        """Count a refused frame; answer an Ack with frame_reject when the sender can be told which frame
        (``answer`` false: the caller answers, or nobody does)."""
        label = exc.label
        self._metrics.tally.inc(self._metrics.frames_rejected, (carrier.name, label))
        suppressed = self._reject_log.allow(label, self._clock())
        if suppressed is not None:
            log.info(
                "frame rejected",
                carrier=carrier.name,
                reason=label,
                detail=exc.detail[:200],
                suppressed_since_last=suppressed,
            )
        if not answer:
            return
        if envelope is None:
            if exc.reason in _BEFORE_ENVELOPE:
                return
            try:
                envelope = pb.Envelope.FromString(bytes(header))
            except Exception:  # noqa: BLE001  (unparseable: there is nobody to tell, and it is counted)
                return
        if not is_valid_id(envelope.message_id) or envelope.kind != pb.MESSAGE_KIND_REQUEST_BATCH:
            return
        ack = pb.Ack(
            acked_message_id=envelope.message_id,
            frame_reject=exc.reason,
            frame_reject_detail=exc.detail[:200],
        )
        frames = self._codec.encode(ack, agent_id=envelope.agent_id, region="hk", dict_id=0)
        self._replies.send_control(carrier, routing_id, frames)
