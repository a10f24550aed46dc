"""``Uplink``: sends requests to the gateway over the best live carrier and routes the answers back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq.asyncio

from edge_agent.config import AgentConfig
from edge_agent.errors import ErrorCounts, ErrorReason
from edge_agent.sockets import send_nowait
from edge_agent.uplink.carriers import Carrier, best_carrier, open_carrier, watch_connection
from edge_agent.uplink.dictionaries import DictionaryNegotiation
from edge_agent.uplink.outstanding import Outstanding, OutstandingTable, SentFrame
from edge_agent.uplink.pacing import SendWindow
from edge_agent.uplink.refusals import (
    FINAL_NACK_STATUS,
    OVER_BUDGET_WAIT_MS,
    RETRYABLE_NACKS,
    RejectAction,
    nack_resend_reason,
    reject_action,
)
from edge_agent.uplink.send_queue import SendQueue
from edgewire import FrameCodec, FrameError, Serialized, labels, new_id, now_unix_us, pb, repeated_field

log = structlog.get_logger("edge_agent.uplink")

OnResponse = Callable[[pb.InferResponse], None]
MIN_TIMER_WAIT_S = 0.001
ANSWERED_WINDOW = 80_000
REQUESTS_FIELD = pb.RequestBatch.DESCRIPTOR.fields_by_name["requests"].number


@dataclass
class UplinkStats:
    """The uplink's counters, read by the agent's metrics."""

    sent_frames: int = 0
    sent_uncompressed: int = 0  # of those, sent without zstd (it would have saved too little)
    compressed_off_loop: int = 0  # request frames encoded on the uplink's thread (compress_off_loop_bytes)
    sent_requests: int = 0
    resent: Counter[str] = field(default_factory=Counter)  # reason -> requests resent
    duplicate_responses: int = 0  # a second answer to a request already answered
    late_responses: int = 0  # an answer after the request's deadline had passed here (caller answered)
    re_executions: int = 0
    frames_rejected: Counter[str] = field(
        default_factory=Counter
    )  # whole frames the gateway refused, by reason
    nacks: Counter[str] = field(default_factory=Counter)  # requests the gateway refused, by reason
    bad_frames: Counter[str] = field(default_factory=Counter)  # frames from Hong Kong not decoded, by reason
    window_full: int = 0  # times requests were queued and the send window had no room for them
    over_budget_holds: int = 0  # over_budget refusals: each held new frames to that gateway back a while


@dataclass(slots=True)
class UnsentFrame:
    """A request frame taken from the queue whose payload is large enough to be compressed off the event
    loop (``batching.compress_off_loop_bytes``): what :meth:`Uplink._send_off_loop` needs to finish it."""

    carrier: Carrier
    batch: list[Outstanding]
    now: float
    put_back: Callable[[list[bytes]], None]
    payload: Serialized
    message_id: bytes
    options: dict[str, Any]


class Uplink:
    """Sends requests to the gateway over the best live carrier and routes the answers back.

    Every request taken stays outstanding until ``on_response`` has been called with its answer (from Hong
    Kong, or made here: deadline passed, refused for good). An accepted request stays in the agent's spool
    until answered, so a restarted agent can ask for it again. See the package docstring for when requests
    are sent again.
    """

    def __init__(
        self,
        config: AgentConfig,
        codec: FrameCodec,
        context: zmq.asyncio.Context,
        on_response: OnResponse,
        curve: tuple[bytes, bytes, bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
        errors: ErrorCounts | None = None,
    ) -> None:
        self._config = config
        self._up = config.uplink
        self._codec = codec
        self._ctx = context
        self._on_response = on_response
        self._curve = curve
        self._clock = clock
        self.errors = errors or ErrorCounts()
        self.carriers: dict[str, Carrier] = {}
        # Ids answered recently (a reused id, a late second answer): the last ANSWERED_WINDOW, not a
        # multiple of max_inflight, which is sized for outages (about 150 bytes an id).
        self.outstanding = OutstandingTable(answered_window=ANSWERED_WINDOW)
        self._queue = SendQueue()
        # Re-asks for answers lost with a carrier: ahead of the queue and outside the send window, which
        # counts them already (the gateway still holds them; a re-ask adds no work there).
        self._reasks: deque[bytes] = deque()
        self._wake = asyncio.Event()  # the sender: something to send, or a carrier came up
        self._timers_changed = asyncio.Event()  # the watchdog: a timer earlier than it sleeps until
        self._watch_until = 0.0
        self._lost_paths: dict[str, float] = {}  # carrier gone silent or removed -> when found so
        # Gateway epoch -> no request frame to that gateway before this (it said the agent is over budget).
        self._held_until: dict[int, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # Records per frame: the config's bound, lowered by the gateway's Pong limits and halved after a
        # frame_too_large refusal, so an oversized batch is split instead of resent unchanged.
        self.max_records = config.batching.max_records
        self.max_frame_bytes = 0  # from the gateway's Pong; 0 = not known yet
        self.dictionaries = DictionaryNegotiation(codec.dictionaries, clock)
        self.stats = UplinkStats()
        self.window = SendWindow(
            self._up.send_window_initial, self._up.send_window_min, self._up.max_inflight
        )
        self._nonce = 0
        # Large request frames are compressed on this thread (zstd lets go of the GIL: the loop reads the
        # intake meanwhile), with a codec of its own (a FrameCodec is not thread-safe) over the same
        # dictionaries; one at a time, so frames leave in the order they were taken.
        self._off_loop_bytes = config.batching.compress_off_loop_bytes
        self._off_loop_codec = FrameCodec(
            codec.limits,
            codec.dictionaries,
            level=codec.level,
            compress_min_bytes=codec.compress_min_bytes,
            min_saving=codec.min_saving,
        )
        self._compressor: ThreadPoolExecutor | None = None

    @property
    def dict_id(self) -> int:
        """The dictionary new frames use: one the gateway advertised in its last Pong (0 = none)."""
        return self.dictionaries.dict_id

    # ------------------------------------------------------------------ carriers

    def set_endpoints(self, endpoints: Sequence[tuple[str, str]]) -> None:
        """Connect to each (name, endpoint); close carriers no longer listed and resend what they held."""
        wanted = dict(endpoints)
        for name in [n for n, c in self.carriers.items() if wanted.get(n) != c.endpoint]:
            self._drop_carrier(name, "endpoint_removed")
        for name, endpoint in wanted.items():
            if name not in self.carriers:
                carrier = open_carrier(self._ctx, name, endpoint, self._up, self._curve)
                carrier.task = asyncio.create_task(self._receive(carrier), name=f"uplink-{name}")
                carrier.monitor_task = asyncio.create_task(
                    watch_connection(carrier, self._connected), name=f"uplink-{name}-monitor"
                )
                self.carriers[name] = carrier

    def _drop_carrier(self, name: str, reason: str) -> None:
        carrier = self.carriers.pop(name)
        for task in (carrier.task, carrier.monitor_task):
            if task is not None:
                task.cancel()
        carrier.close()
        self._resend_unacked_on(name, reason)
        self._lost_paths[name] = self._clock()

    def best(self) -> Carrier | None:
        """The live carrier with the lowest RTT (ties: name), or None."""
        return best_carrier(self.carriers.values(), self._clock(), self._up.dead_after_s)

    def rtt_s(self) -> float | None:
        best = self.best()
        return None if best is None else best.rtt_s

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._off_loop_bytes and self._compressor is None:
            self._compressor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink-zstd")
        self._tasks = [
            asyncio.create_task(self._sender(), name="uplink-sender"),
            asyncio.create_task(self._pinger(), name="uplink-pinger"),
            asyncio.create_task(self._watchdog(), name="uplink-watchdog"),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._compressor is not None:
            self._compressor.shutdown(wait=False)  # a frame being compressed is not sent (it is spooled)
            self._compressor = None
        for name in list(self.carriers):
            carrier = self.carriers.pop(name)
            tasks = [t for t in (carrier.task, carrier.monitor_task) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            carrier.close()

    # ------------------------------------------------------------------ sending

    @property
    def inflight(self) -> int:
        return len(self.outstanding)

    def knows(self, request_id: bytes) -> bool:
        """True while the id is outstanding or was answered recently (a reused id)."""
        return self.outstanding.knows(request_id)

    def has_room(self, n: int = 1, *, realtime: bool = False) -> bool:
        """Whether ``n`` more requests fit in ``max_inflight``; less urgent ones leave ``realtime_reserve``
        of it to realtime requests (a region's prefetch filling the agent does not refuse its page renders),
        at most half of it."""
        limit = self._up.max_inflight
        if not realtime:
            limit -= min(self._up.realtime_reserve, limit // 2)
        return len(self.outstanding) + n <= limit

    def submit(self, requests: Sequence[pb.InferRequest], raws: Sequence[bytes] | None = None) -> None:
        """Take requests for Hong Kong (``raws``: each serialized, when made already: frames carry those
        bytes); they are outstanding until answered or expired."""
        earliest: float | None = None
        added: list[bytes] = []
        add = self.outstanding.add
        for i, request in enumerate(requests):
            if add(request, None if raws is None else raws[i]):
                added.append(request.request_id)
                deadline = request.deadline_unix_us
                if deadline and (earliest is None or deadline < earliest):
                    earliest = deadline
        self._queue.push(self.outstanding, added)
        if earliest is not None:
            self._timer_set(self._clock() + (earliest - now_unix_us()) / 1e6)
        self._wake.set()

    async def _sender(self) -> None:
        linger = self._config.batching.linger_ms / 1000
        while True:
            if not self._queue and not self._reasks:
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._queue) < self.max_records and linger:
                await asyncio.sleep(linger)  # linger: let the batch fill for at most linger_ms
            carrier, held_s = self._unheld(self.best(), self._clock())
            wait_s: float | None = held_s or self._up.ping_interval_s
            if carrier is not None:
                try:
                    outcome = self._send_some(carrier)
                    if isinstance(outcome, UnsentFrame):
                        outcome = await self._send_off_loop(outcome)
                    wait_s = outcome
                except Exception:  # never let one bad batch end the sender
                    self.errors.count(ErrorReason.UPLINK_SEND)
                    log.exception("sending a batch failed", carrier=carrier.name, queued=len(self._queue))
            if wait_s is None:
                await asyncio.sleep(0)  # sent something: yield, then go on with the queue
                continue
            # Nothing could go out (no live carrier, a full send buffer, or everything waiting out a
            # retry-after): wait for news or for the earliest retry, never spin.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.001, wait_s))

    def _unheld(self, best: Carrier | None, now: float) -> tuple[Carrier | None, float]:
        """The carrier for the next request frame: ``best``, unless its gateway holds this agent back (over
        budget); then the best live carrier to another gateway, or none and the seconds until a hold ends."""
        if best is None or not self._held_until:
            return best, 0.0
        for epoch in [e for e, until in self._held_until.items() if until <= now]:
            del self._held_until[epoch]
        if best.epoch not in self._held_until:
            return best, 0.0
        free = (c for c in self.carriers.values() if c.epoch not in self._held_until)
        other = best_carrier(free, now, self._up.dead_after_s)
        if other is not None:
            return other, 0.0
        return None, max(MIN_TIMER_WAIT_S, min(self._held_until.values()) - now)

    def _send_some(self, carrier: Carrier) -> float | UnsentFrame | None:
        """Send one frame; None when it went out, else how long to wait before trying again (or, a large
        one, the frame to compress off the loop and send: :meth:`_send_off_loop`)."""
        if self._reasks:
            return self._send_reasks(carrier)
        room = self.window.room(self.outstanding.held)
        realtime_only = False
        if not room:  # an answer, a refusal or a resend opens it, and wakes the sender
            reserve = self._up.realtime_reserve - self.outstanding.held_realtime
            if reserve <= 0 or not self._queue.realtime_waiting:
                self.stats.window_full += 1
                return self._up.ping_interval_s
            room, realtime_only = reserve, True  # realtime requests past the full window, up to the reserve
        now = self._clock()
        chosen = self._queue.take(
            self.outstanding,
            now,
            now_unix_us(),
            min(self.max_records, room),
            self._config.batching.max_bytes,
            self._up.ping_interval_s,
            realtime_only=realtime_only,
        )
        for rid in chosen.expired:
            self._expire(rid)
        if not chosen.entries:
            return chosen.wait_s
        return self._send_batch(
            carrier, chosen.entries, now, lambda ids: self._queue.push_front(self.outstanding, ids)
        )

    def _send_reasks(self, carrier: Carrier) -> float | UnsentFrame | None:
        """One frame of re-asks (those still unanswered and not acknowledged again since)."""
        batch: list[Outstanding] = []
        while self._reasks and len(batch) < self.max_records:
            entry = self.outstanding.get(self._reasks.popleft())
            if entry is not None and not entry.accepted:
                batch.append(entry)
        if not batch:
            return None  # nothing left to re-ask: the queue's turn
        return self._send_batch(
            carrier, batch, self._clock(), lambda ids: self._reasks.extendleft(reversed(ids))
        )

    def _send_batch(
        self,
        carrier: Carrier,
        batch: list[Outstanding],
        now: float,
        put_back: Callable[[list[bytes]], None],
    ) -> float | UnsentFrame | None:
        """Send ``batch`` as one frame (``put_back`` its ids when it cannot go now); as ``_send_some``. A
        frame of at least ``batching.compress_off_loop_bytes`` is returned unsent, to be compressed off the
        loop."""
        message_id = new_id()
        requests = [e.request for e in batch]
        attempt = max(e.attempts for e in batch)
        deadline = min((d for r in requests if (d := r.deadline_unix_us)), default=0)
        priority = min(r.priority or pb.PRIORITY_CLASS_INTERACTIVE for r in requests)
        # The requests as serialized when taken: a RequestBatch is the concatenation of its requests,
        # so none is copied into a new message or serialized again.
        payload = Serialized(
            pb.MESSAGE_KIND_REQUEST_BATCH, repeated_field(REQUESTS_FIELD, [e.raw for e in batch]), len(batch)
        )
        options: dict[str, Any] = {
            "agent_id": self._config.name,
            "region": self._config.region,
            "priority": priority,
            "deadline_unix_us": deadline,
            "message_id": message_id,
            "attempt": attempt,
            "dict_id": self.dict_id,
            "frame_limit": self.max_frame_bytes,  # the gateway's, from its Pong (0 = not known yet)
            "features": pb.FEATURE_ACKS_IN_RESPONSES,
        }
        if self._compressor is not None and len(payload.raw) >= self._off_loop_bytes:
            return UnsentFrame(carrier, batch, now, put_back, payload, message_id, options)
        raw_before = self._codec.sent_raw
        frames = self._codec.encode(payload, **options)
        return self._send_frames(
            carrier, batch, now, put_back, frames, message_id, self._codec.sent_raw != raw_before
        )

    async def _send_off_loop(self, unsent: UnsentFrame) -> float | None:
        """Compress a large frame on the uplink's thread, then send it as ``_send_batch`` would. What changed
        while it was compressed is checked after: a request answered or expired meanwhile (no longer
        outstanding) or a carrier dropped puts the rest back, to go in the next frame; cancelled (the agent
        stopping), they are put back too."""
        assert self._compressor is not None
        codec = self._off_loop_codec
        raw_before = codec.sent_raw  # only that thread changes it, and it is idle until this job runs
        job = functools.partial(codec.encode, unsent.payload, **unsent.options)
        batch = unsent.batch
        try:
            frames = await asyncio.get_running_loop().run_in_executor(self._compressor, job)
        except asyncio.CancelledError:
            unsent.put_back([e.request.request_id for e in batch])
            raise
        self.stats.compressed_off_loop += 1
        get = self.outstanding.get
        live = [e for e in batch if get(e.request.request_id) is e]
        carrier = unsent.carrier
        if len(live) != len(batch) or self.carriers.get(carrier.name) is not carrier:
            unsent.put_back([e.request.request_id for e in live])
            return None
        sent_raw = codec.sent_raw != raw_before
        return self._send_frames(
            carrier, batch, unsent.now, unsent.put_back, frames, unsent.message_id, sent_raw
        )

    def _send_frames(
        self,
        carrier: Carrier,
        batch: list[Outstanding],
        now: float,
        put_back: Callable[[list[bytes]], None],
        frames: list[bytes],
        message_id: bytes,
        sent_raw: bool,
    ) -> float | None:
        """Send a request frame encoded from ``batch``; as ``_send_some``. ``sent_raw``: zstd would not have
        saved ``zstd_min_saving``, so it goes uncompressed."""
        ids = [e.request.request_id for e in batch]
        if self.max_frame_bytes and len(frames[1]) > self.max_frame_bytes:
            # Over the gateway's limit: the gateway (or libzmq, far over it) would refuse it. Split.
            if len(batch) == 1:
                self._fail_ids(
                    ids, pb.STATUS_INVALID_ARGUMENT, "request larger than the gateway's frame limit"
                )
            else:
                self.max_records = max(1, len(batch) // 2)
                put_back(ids)
            return None
        if not send_nowait(carrier.sock, frames):  # HWM reached or not connected: try again later
            put_back(ids)
            return min(0.05, self._up.ping_interval_s)
        self.outstanding.sent(SentFrame(message_id, carrier.name, ids, now), self._up.ack_timeout_s)
        self._timer_set(now + self._up.ack_timeout_s)
        self.stats.sent_frames += 1
        self.stats.sent_requests += len(ids)
        if sent_raw:
            self.stats.sent_uncompressed += 1
        return None

    def _resend(self, ids: Iterable[bytes], reason: str, not_before: float = 0.0) -> None:
        again: list[bytes] = []
        for rid in ids:
            entry = self.outstanding.get(rid)
            if entry is None:
                continue
            entry.attempts += 1
            entry.not_before = not_before
            entry.frame = b""
            self.outstanding.release(entry)
            again.append(rid)
        if again:
            self._queue.push(self.outstanding, again)
            self.stats.resent[reason] += len(again)
            self._wake.set()

    def _retry_at(self, now: float, retry_after_ms: int) -> float:
        """When a refused request may go again: the gateway's retry-after, spread over [1, 1 +
        retry_jitter] of it, so that what one Ack refused does not come back all at once."""
        return now + retry_after_ms / 1000 * random.uniform(1.0, 1.0 + self._up.retry_jitter)

    def _resend_unacked_on(self, carrier: str, reason: str) -> None:
        """A carrier died or was removed: its frames not acknowledged yet go out again elsewhere."""
        unacked = [rid for frame in self.outstanding.frames_on(carrier) for rid in frame.ids]
        self._resend(self.outstanding.unaccepted(unacked), reason)

    def _resend_stranded(self, via: Carrier, now: float) -> None:
        """A Pong on ``via`` after a carrier went silent or was removed: the gateway is there, and the
        answers to what it accepted over the lost carrier may have been lost with it (a black-holed link
        keeps its TCP connection up while the answers sent into it go nowhere). The agent asks again for
        those (``via``'s gateway epoch only: an older one is ``_gateway_restarted``'s): the same requests,
        next on the wire, outside the send window (the gateway holds them already). Its dedupe window
        acknowledges each as a duplicate and never runs it twice: one still running is answered when done,
        one answered already from its response cache, either on the carrier the re-ask came on."""
        lost = {name for name, at in self._lost_paths.items() if at < now}
        if not lost:
            return
        for name in lost:
            del self._lost_paths[name]
        stranded = self.outstanding.accepted_by(epochs={via.epoch}, on=lost)
        for rid in stranded:
            entry = self.outstanding.get(rid)
            if entry is not None:
                entry.accepted = False  # until the re-ask's Ack: without one it is resent as unacked
                entry.attempts += 1
                entry.frame = b""
        if stranded:
            self._reasks.extend(stranded)
            self.stats.resent["carrier_down"] += len(stranded)
            self._wake.set()

    def _expire(self, rid: bytes) -> None:
        entry = self.outstanding.close(rid, expired=True)
        if entry is not None:
            self._on_response(
                pb.InferResponse(
                    request_id=rid,
                    status=pb.STATUS_DEADLINE_EXCEEDED,
                    error_message="deadline passed before an answer from Hong Kong",
                    model_name=entry.request.model_name,
                )
            )

    def _answer(self, response: pb.InferResponse) -> None:
        """An answer made here (a final refusal): the request is no longer outstanding."""
        if self.outstanding.close(response.request_id) is not None:
            self._on_response(response)

    def _fail_ids(self, ids: Iterable[bytes], status: pb.Status.ValueType, message: str) -> None:
        for rid in ids:
            self._answer(pb.InferResponse(request_id=rid, status=status, error_message=message))

    # ------------------------------------------------------------------ receiving

    async def _receive(self, carrier: Carrier) -> None:
        while True:
            frames = await carrier.sock.recv_multipart()
            try:
                decoded = self._codec.decode(frames)
            except FrameError as exc:
                self.stats.bad_frames[exc.label] += 1
                log.warning("bad frame from gateway", carrier=carrier.name, reason=exc.label)
                continue
            try:
                self._dispatch(carrier, decoded.payload)
            except Exception:  # a failing callback (e.g. the spool's disk) must not end this carrier's loop
                self.errors.count(ErrorReason.GATEWAY_FRAME)
                log.exception(
                    "handling a frame from the gateway failed",
                    carrier=carrier.name,
                    message=type(decoded.payload).__name__,
                )

    def _dispatch(self, carrier: Carrier, payload: object) -> None:
        if isinstance(payload, pb.Ack):
            self._on_ack(carrier, payload)
        elif isinstance(payload, pb.ResponseBatch):
            for ack in payload.acks:  # Acks riding with answers: first, as if they had come just before
                self._on_ack(carrier, ack)
            for response in payload.responses:
                self._on_gateway_response(response)
        elif isinstance(payload, pb.Pong):
            self._on_pong(carrier, payload)
        elif isinstance(payload, pb.DictionaryResponse):
            self.dictionaries.on_dictionary(payload)
        if self._queue:  # an answer or a refusal may have opened the send window
            self._wake.set()

    def _on_ack(self, carrier: Carrier, ack: pb.Ack) -> None:
        frame = self.outstanding.acked(ack.acked_message_id)
        if ack.frame_reject:
            self._on_frame_rejected(carrier, ack, frame)
            return
        accepted = [*ack.accepted_ids, *ack.duplicate_ids]
        for rid in accepted:
            entry = self.outstanding.get(rid)
            if entry is not None:
                entry.accepted = True
                entry.epoch = carrier.epoch
        now = self._clock()
        for nack in ack.nacks:
            self.stats.nacks[labels.NACK.get(nack.reason, "other") if nack.reason else "other"] += 1
            if nack.reason in RETRYABLE_NACKS:
                if nack.reason == pb.NACK_REASON_OVERLOADED:
                    self.window.overloaded(frame.sent_at if frame else now, now)
                self._resend(
                    [nack.request_id],
                    nack_resend_reason(nack.reason),
                    not_before=self._retry_at(now, nack.retry_after_ms),
                )
            else:
                self._answer(
                    pb.InferResponse(
                        request_id=nack.request_id,
                        status=FINAL_NACK_STATUS.get(nack.reason, pb.STATUS_INTERNAL),
                        error_message=nack.detail,
                    )
                )

    def _on_frame_rejected(self, carrier: Carrier, ack: pb.Ack, frame: SentFrame | None) -> None:
        self.stats.frames_rejected[labels.REJECT.get(ack.frame_reject, "other")] += 1
        ids = frame.ids if frame else []
        action = reject_action(ack.frame_reject)
        if action is RejectAction.WAIT:
            self._over_budget(carrier, ack, frame)
        elif action is RejectAction.RESEND:
            self.dictionaries.refused()  # resend without one; the next Pong says what the gateway decodes
            self._resend(ids, "frame_rejected")
        elif action is RejectAction.SPLIT and len(ids) != 1:
            self.max_records = max(1, min(self.max_records, len(ids)) // 2)
            self._resend(ids, "frame_rejected")
        elif action is RejectAction.SPLIT:  # one request alone over the gateway's limits can never pass
            self._fail_ids(
                ids, pb.STATUS_INVALID_ARGUMENT, f"too large for the gateway: {ack.frame_reject_detail}"
            )
        else:
            self._fail_ids(ids, pb.STATUS_INTERNAL, f"gateway refused the frame: {ack.frame_reject_detail}")

    def _over_budget(self, carrier: Carrier, ack: pb.Ack, frame: SentFrame | None) -> None:
        """The gateway refused a frame before decoding it: this agent is over its cost budget there. Hold
        every request frame to that gateway back for the retry-after (frames already on their way are
        refused likewise and only extend it), send the refused requests again after it (not failed), and
        halve the send window as for OVERLOADED, so that the agent settles under its budget instead of
        meeting it again with the whole queue."""
        now = self._clock()
        wait_ms = ack.frame_retry_after_ms or OVER_BUDGET_WAIT_MS
        until = now + wait_ms / 1000
        if until > self._held_until.get(carrier.epoch, 0.0):
            self._held_until[carrier.epoch] = until
        self.stats.over_budget_holds += 1
        if frame is not None:
            self.window.overloaded(frame.sent_at, now)
            self._resend(frame.ids, "over_budget", not_before=self._retry_at(now, wait_ms))

    def _on_gateway_response(self, response: pb.InferResponse) -> None:
        entry = self.outstanding.get(response.request_id)
        if entry is None:
            if self.outstanding.expired_unanswered(response.request_id):
                self.stats.late_responses += 1  # its caller got DEADLINE_EXCEEDED already
            else:
                self.stats.duplicate_responses += 1
            return
        if response.status in (pb.STATUS_OVERLOADED, pb.STATUS_UNAVAILABLE):
            now = self._clock()
            if response.status == pb.STATUS_OVERLOADED:
                self.window.overloaded(entry.sent_at, now)
            entry.accepted = False
            self._resend(
                [response.request_id],
                "retryable_status",
                not_before=self._retry_at(now, response.retry_after_ms),
            )
            return
        held = self.outstanding.held
        if self.outstanding.release(entry):
            self.window.answered(1, held)
        self.outstanding.close(response.request_id)
        self._on_response(response)

    def _on_pong(self, carrier: Carrier, pong: pb.Pong) -> None:
        now = self._clock()
        carrier.pong(now, max(0.0, (now_unix_us() - pong.ping_sent_at_unix_us) / 1e6), pong.draining)
        if carrier.epoch and pong.gateway_epoch != carrier.epoch:
            self._gateway_restarted(carrier.epoch)
        carrier.epoch = pong.gateway_epoch
        # Each Pong resets the records bound (a split after an oversized frame is temporary).
        self.max_records = min(self._config.batching.max_records, pong.limits.max_records or 1 << 30)
        self.max_frame_bytes = pong.limits.max_frame_bytes
        self.dictionaries.on_pong(pong, lambda request: self._send_control(carrier, request))
        self._check_carrier(carrier, now)
        if carrier.up:
            if self._lost_paths:
                self._resend_stranded(carrier, now)
            self._timer_set(carrier.dies_at(self._up.dead_after_s))
        self._wake.set()

    def _send_control(self, carrier: Carrier, message: pb.DictionaryRequest | pb.Ping) -> bool:
        frames = self._codec.encode(message, agent_id=self._config.name, region=self._config.region)
        return send_nowait(carrier.sock, frames)

    def _gateway_restarted(self, old_epoch: int) -> None:
        """The gateway lost its in-memory work: resend what it had accepted and not answered, paced by a
        send window that starts again from its initial size (the new process's queues are empty)."""
        self.window.restart(self._clock())
        lost = self.outstanding.accepted_by(epochs={old_epoch})
        for rid in lost:
            entry = self.outstanding.get(rid)
            if entry is not None:
                entry.accepted = False
        self.stats.re_executions += len(lost)
        log.warning("gateway restarted; resending accepted work", requests=len(lost))
        self._resend(lost, "gateway_restarted")

    # ------------------------------------------------------------------ timers

    async def _pinger(self) -> None:
        while True:
            for carrier in list(self.carriers.values()):
                self._ping(carrier)  # dropped while the carrier is not connected
            await asyncio.sleep(self._up.ping_interval_s)

    def _ping(self, carrier: Carrier) -> None:
        self._nonce += 1
        self._send_control(carrier, pb.Ping(nonce=self._nonce, dict_ids=self._codec.dictionaries.ids()))

    def _connected(self, carrier: Carrier) -> None:
        """A carrier's ZMTP handshake completed (first connection or a reconnect): ping it now, so that it
        counts as live one round trip later, not up to a ping interval later."""
        if self.carriers.get(carrier.name) is carrier:
            self._ping(carrier)

    def _timer_set(self, at: float) -> None:
        """A timer at monotonic ``at``: wake the watchdog if it sleeps past it."""
        if at < self._watch_until:
            self._timers_changed.set()

    async def _watchdog(self) -> None:
        """Sleeps until the next timer is due (an Ack overdue, a carrier silent too long, a deadline)."""
        while True:
            now = self._clock()
            try:
                self._check_timers(now, now_unix_us())
            except Exception:  # never let a callback error end the watchdog
                self.errors.count(ErrorReason.UPLINK_TIMERS)
                log.exception("uplink watchdog failed")
            wait_s = max(MIN_TIMER_WAIT_S, self._next_timer(now, now_unix_us()) - now)
            self._watch_until = now + wait_s
            self._timers_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._timers_changed.wait(), timeout=wait_s)

    def _next_timer(self, now: float, wall_us: int) -> float:
        """The monotonic time of the earliest timer held (or a ping interval from now, with none)."""
        due = [now + self._up.ping_interval_s]
        ack = self.outstanding.next_ack_due()
        if ack is not None:
            due.append(ack)
        expiry = self.outstanding.next_expiry_us()
        if expiry is not None:
            due.append(now + (expiry - wall_us) / 1e6)
        due.extend(c.dies_at(self._up.dead_after_s) for c in self.carriers.values() if c.up)
        return min(due)

    def _check_timers(self, now: float, wall_us: int) -> None:
        for carrier in list(self.carriers.values()):
            self._check_carrier(carrier, now)
        for frame in self.outstanding.overdue_frames(now):
            self._resend(self.outstanding.unaccepted(frame.ids), "ack_timeout")
        for rid in self.outstanding.expired(wall_us):
            self._expire(rid)

    def _check_carrier(self, carrier: Carrier, now: float) -> None:
        """When a carrier goes from live to dead (silent or draining) or back: resend what it held."""
        alive = carrier.alive(now, self._up.dead_after_s)
        if alive == carrier.up:
            return
        carrier.up = alive
        if alive:
            carrier.came_up += 1
        else:
            carrier.went_down += 1
            self._resend_unacked_on(carrier.name, "carrier_down")
            if not carrier.draining:  # a draining gateway still answers on it
                self._lost_paths[carrier.name] = now
