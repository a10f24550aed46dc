"""The uplink to Hong Kong: one DEALER per carrier ingress (the zguide Freelance pattern), with liveness
and RTT per carrier, batching, acknowledgement tracking, failover resends and gateway-restart recovery.

Every request sent stays *outstanding* until its response arrives or its deadline passes:

* unacknowledged: sent in a frame that got no Ack yet. When the frame's carrier dies (no Pong for
  ``dead_after_s``) or the Ack does not come within ``ack_timeout_s``, the request is resent on the best
  other carrier with ``attempt + 1``; the gateway's shared dedupe window makes that safe.
* accepted: the gateway owns it (the agent's spool may drop it). If the gateway's epoch changes (it
  restarted and lost its in-memory work), accepted requests still waiting are resent; these re-executions
  are counted and bounded by ``max_inflight``.

A response for an id no longer outstanding (already answered, or a second copy after a failover) is
dropped and counted, so a caller never receives two answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import structlog
import zmq
import zmq.asyncio

from edge_agent.config import AgentConfig
from edgewire import DictionaryError, FrameCodec, FrameError, labels, new_id, now_unix_us, pb

log = structlog.get_logger("edge_agent.uplink")

OnResponse = Callable[[pb.InferResponse], None]
OnAccepted = Callable[[list[bytes]], None]
RETRYABLE_NACKS = frozenset({pb.NACK_REASON_OVERLOADED, pb.NACK_REASON_DRAINING})
FINAL_NACK_STATUS = {
    pb.NACK_REASON_DEADLINE_EXPIRED: pb.STATUS_DEADLINE_EXCEEDED,
    pb.NACK_REASON_INVALID_REQUEST: pb.STATUS_INVALID_ARGUMENT,
    pb.NACK_REASON_UNKNOWN_MODEL: pb.STATUS_MODEL_NOT_FOUND,
}
RESENDABLE_REJECTS = frozenset(
    {
        pb.REJECT_REASON_UNKNOWN_DICTIONARY,
        pb.REJECT_REASON_FRAME_TOO_LARGE,
        pb.REJECT_REASON_DECLARED_TOO_LARGE,
        pb.REJECT_REASON_TOO_MANY_RECORDS,
    }
)


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
    """Non-blocking send; False when ZeroMQ would block (the outcome is on the returned future)."""
    future = cast("asyncio.Future[object]", sock.send_multipart(frames, flags=zmq.NOBLOCK))
    if not future.done():
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True
    return future.exception() is None


@dataclass(slots=True)
class Carrier:
    """One carrier ingress as this agent sees it."""

    name: str
    endpoint: str
    sock: zmq.asyncio.Socket
    rtt_s: float = 0.0
    last_pong: float = 0.0
    epoch: int = 0
    draining: bool = False
    task: asyncio.Task[None] | None = None

    def alive(self, now: float, dead_after_s: float) -> bool:
        return self.last_pong > 0 and now - self.last_pong < dead_after_s and not self.draining


@dataclass(slots=True)
class Outstanding:
    request: pb.InferRequest
    accepted: bool = False
    epoch: int = 0  # gateway epoch when accepted
    frame: bytes = b""  # message id of the frame it was last sent in
    attempts: int = 0
    not_before: float = 0.0  # retry-after of a retryable nack


@dataclass(slots=True)
class _Frame:
    carrier: str
    ids: list[bytes]
    sent_at: float


@dataclass
class UplinkStats:
    sent_frames: int = 0
    sent_uncompressed: int = 0  # of those, sent without zstd (it would have saved too little)
    sent_requests: int = 0
    resent: Counter[str] = field(default_factory=Counter)  # reason -> requests resent
    duplicate_responses: int = 0
    re_executions: int = 0
    frames_rejected: Counter[str] = field(
        default_factory=Counter
    )  # whole frames the gateway refused, by reason
    nacks: Counter[str] = field(default_factory=Counter)  # requests the gateway refused, by reason


class Uplink:
    """Sends requests to the gateway over the best live carrier and routes the answers back."""

    def __init__(
        self,
        config: AgentConfig,
        codec: FrameCodec,
        context: zmq.asyncio.Context,
        on_response: OnResponse,
        on_accepted: OnAccepted,
        curve: tuple[bytes, bytes, bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._up = config.uplink
        self._codec = codec
        self._ctx = context
        self._on_response = on_response
        self._on_accepted = on_accepted
        self._curve = curve
        self._clock = clock
        self.carriers: dict[str, Carrier] = {}
        self.outstanding: OrderedDict[bytes, Outstanding] = OrderedDict()
        self._queue: list[bytes] = []  # ids waiting for the next frame
        self._frames: dict[bytes, _Frame] = {}  # unacked frames
        self._answered: OrderedDict[bytes, None] = OrderedDict()  # recently answered ids (bounded)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Records per frame: the config's bound, lowered by the gateway's Pong limits and halved after a
        # frame_too_large refusal, so an oversized batch is split instead of resent unchanged.
        self.max_records = config.batching.max_records
        self.max_frame_bytes = 0  # from the gateway's Pong; 0 = not known yet
        # Dictionary in use: only one the gateway advertised in its last Pong (0 = none yet).
        self.dict_id = 0
        self._dict_requested: dict[int, float] = {}  # dictionary id -> when it may be asked for again
        self.stats = UplinkStats()

    # ------------------------------------------------------------------ carriers

    def set_endpoints(self, endpoints: Sequence[tuple[str, str]]) -> None:
        """Connect to each (name, endpoint); close carriers no longer listed and resend what they held."""
        wanted = dict(endpoints)
        for name in [n for n, c in self.carriers.items() if wanted.get(n) != c.endpoint]:
            self._drop_carrier(name, "endpoint_removed")
        for name, endpoint in wanted.items():
            if name not in self.carriers:
                self._add_carrier(name, endpoint)

    def _add_carrier(self, name: str, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        up = self._up
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, up.sndhwm)
        sock.setsockopt(zmq.RCVHWM, up.sndhwm)
        # libzmq doubles the interval up to the cap but does not randomise it when a cap is set: spread each
        # socket's base interval so that a region's agents do not reconnect in lockstep after an outage.
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(up.reconnect_ivl_ms * random.uniform(0.5, 1.5))))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, up.reconnect_ivl_max_ms)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(up.dead_after_s * 1000))
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a carrier that is not connected
        if self._curve is not None:
            public, secret, server = self._curve
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
        sock.connect(endpoint)
        carrier = Carrier(name, endpoint, sock)
        carrier.task = asyncio.create_task(self._receive(carrier), name=f"uplink-{name}")
        self.carriers[name] = carrier

    def _drop_carrier(self, name: str, reason: str) -> None:
        carrier = self.carriers.pop(name)
        if carrier.task is not None:
            carrier.task.cancel()
        carrier.sock.close(0)
        self._resend_frames_of(name, reason)

    def best(self) -> Carrier | None:
        """The live carrier with the lowest RTT (ties: name), or None."""
        now = self._clock()
        live = [c for c in self.carriers.values() if c.alive(now, self._up.dead_after_s)]
        return min(live, key=lambda c: (c.rtt_s, c.name), default=None)

    def rtt_s(self) -> float | None:
        best = self.best()
        return None if best is None else best.rtt_s

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
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
        for name in list(self.carriers):
            carrier = self.carriers.pop(name)
            if carrier.task is not None:
                carrier.task.cancel()
                await asyncio.gather(carrier.task, return_exceptions=True)
            carrier.sock.close(0)

    # ------------------------------------------------------------------ sending

    @property
    def inflight(self) -> int:
        return len(self.outstanding)

    def knows(self, request_id: bytes) -> bool:
        """True while the id is outstanding or was answered recently (a reused id)."""
        return request_id in self.outstanding or request_id in self._answered

    def has_room(self, n: int = 1) -> bool:
        return len(self.outstanding) + n <= self._up.max_inflight

    def submit(self, requests: Iterable[pb.InferRequest]) -> None:
        """Take requests for Hong Kong; they are outstanding until answered or expired."""
        for request in requests:
            rid = request.request_id
            if rid in self.outstanding or rid in self._answered:
                continue
            self.outstanding[rid] = Outstanding(request)
            self._queue.append(rid)
        self._wake.set()

    async def _sender(self) -> None:
        batching = self._config.batching
        linger = batching.linger_ms / 1000
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._queue) < self.max_records and linger:
                await asyncio.sleep(linger)  # linger: let the batch fill for at most linger_ms
            carrier = self.best()
            wait_s: float | None = self._up.ping_interval_s
            if carrier is not None:
                try:
                    wait_s = self._send_some(carrier)
                except Exception:  # never let one bad batch end the sender
                    log.exception("sending a batch failed")
            if wait_s is None:
                await asyncio.sleep(0)  # sent something: yield, then go on with the queue
                continue
            # Nothing could go out (no live carrier, a full send buffer, or everything waiting out a
            # retry-after): wait for news or for the earliest retry, never spin.
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.001, wait_s))

    def _send_some(self, carrier: Carrier) -> float | None:
        """Send one frame; None when it went out, else how long to wait before trying again."""
        batching = self._config.batching
        now = self._clock()
        wall = now_unix_us()
        batch: list[pb.InferRequest] = []
        size = 0
        rest: list[bytes] = []
        for rid in self._queue:
            entry = self.outstanding.get(rid)
            if entry is None:
                continue
            if entry.not_before > now or len(batch) >= self.max_records or size >= batching.max_bytes:
                rest.append(rid)
                continue
            if entry.request.deadline_unix_us and entry.request.deadline_unix_us <= wall:
                self._expire(rid)
                continue
            batch.append(entry.request)
            size += entry.request.ByteSize()
        self._queue = rest
        if not batch:
            waits = [self.outstanding[r].not_before - now for r in rest if r in self.outstanding]
            return min(waits, default=self._up.ping_interval_s)
        message_id = new_id()
        attempt = max(self.outstanding[r.request_id].attempts for r in batch)
        deadline = min((r.deadline_unix_us for r in batch if r.deadline_unix_us), default=0)
        priority = min(r.priority or pb.PRIORITY_CLASS_INTERACTIVE for r in batch)
        raw_before = self._codec.sent_raw
        frames = self._codec.encode(
            pb.RequestBatch(requests=batch),
            agent_id=self._config.name,
            region=self._config.region,
            priority=priority,
            deadline_unix_us=deadline,
            message_id=message_id,
            attempt=attempt,
            dict_id=self.dict_id,
            frame_limit=self.max_frame_bytes,  # the gateway's, from its Pong (0 = not known yet)
        )
        if self.max_frame_bytes and len(frames[1]) > self.max_frame_bytes:
            # Over the gateway's limit: the gateway (or libzmq, far over it) would refuse it. Split.
            if len(batch) == 1:
                self._fail_ids(
                    [batch[0].request_id],
                    pb.STATUS_INVALID_ARGUMENT,
                    "request larger than the gateway's frame limit",
                )
            else:
                self.max_records = max(1, len(batch) // 2)
                self._queue = [r.request_id for r in batch] + self._queue
            return None
        if not send_nowait(carrier.sock, frames):  # HWM reached or not connected: try again later
            self._queue = [r.request_id for r in batch] + self._queue
            return min(0.05, self._up.ping_interval_s)
        ids = [r.request_id for r in batch]
        for rid in ids:
            self.outstanding[rid].frame = message_id
        self._frames[message_id] = _Frame(carrier.name, ids, now)
        self.stats.sent_frames += 1
        self.stats.sent_requests += len(ids)
        if self._codec.sent_raw != raw_before:  # zstd would not have saved zstd_min_saving
            self.stats.sent_uncompressed += 1
        return None

    def _resend(self, ids: Iterable[bytes], reason: str, not_before: float = 0.0) -> None:
        count = 0
        for rid in ids:
            entry = self.outstanding.get(rid)
            if entry is None:
                continue
            entry.attempts += 1
            entry.not_before = not_before
            entry.frame = b""
            self._queue.append(rid)
            count += 1
        if count:
            self.stats.resent[reason] += count
            self._wake.set()

    def _resend_frames_of(self, carrier: str, reason: str) -> None:
        for message_id in [m for m, f in self._frames.items() if f.carrier == carrier]:
            frame = self._frames.pop(message_id)
            self._resend(
                [rid for rid in frame.ids if rid in self.outstanding and not self.outstanding[rid].accepted],
                reason,
            )

    def _expire(self, rid: bytes) -> None:
        entry = self.outstanding.pop(rid, None)
        if entry is not None:
            self._finish(
                pb.InferResponse(
                    request_id=rid,
                    status=pb.STATUS_DEADLINE_EXCEEDED,
                    error_message="deadline passed before an answer from Hong Kong",
                    model_name=entry.request.model_name,
                )
            )

    def _finish(self, response: pb.InferResponse) -> None:
        self._answered[response.request_id] = None
        while len(self._answered) > 4 * self._up.max_inflight:
            self._answered.popitem(last=False)
        self._on_response(response)

    # ------------------------------------------------------------------ receiving

    async def _receive(self, carrier: Carrier) -> None:
        while True:
            frames = await carrier.sock.recv_multipart()
            try:
                decoded = self._codec.decode(frames)
            except FrameError as exc:
                log.warning("bad frame from gateway", carrier=carrier.name, reason=exc.label)
                continue
            try:
                self._dispatch(carrier, decoded.payload)
            except Exception:  # a failing callback (e.g. the spool's disk) must not end this carrier's loop
                log.exception("handling a frame from the gateway failed", carrier=carrier.name)

    def _dispatch(self, carrier: Carrier, payload: object) -> None:
        if isinstance(payload, pb.Ack):
            self._on_ack(carrier, payload)
        elif isinstance(payload, pb.ResponseBatch):
            for response in payload.responses:
                self._on_gateway_response(response)
        elif isinstance(payload, pb.Pong):
            self._on_pong(carrier, payload)
        elif isinstance(payload, pb.DictionaryResponse):
            self._on_dictionary(payload)

    def _on_ack(self, carrier: Carrier, ack: pb.Ack) -> None:
        frame = self._frames.pop(ack.acked_message_id, None)
        if ack.frame_reject:
            self.stats.frames_rejected[labels.REJECT.get(ack.frame_reject, "other")] += 1
            ids = frame.ids if frame else []
            if ack.frame_reject == pb.REJECT_REASON_UNKNOWN_DICTIONARY:
                self.dict_id = 0  # resend without one; the next Pong says what the gateway decodes
            if (
                ack.frame_reject in RESENDABLE_REJECTS
                and ack.frame_reject != pb.REJECT_REASON_UNKNOWN_DICTIONARY
            ):
                if len(ids) == 1:  # one request alone is over the gateway's limits: it can never pass
                    self._fail_ids(
                        ids,
                        pb.STATUS_INVALID_ARGUMENT,
                        f"too large for the gateway: {ack.frame_reject_detail}",
                    )
                    return
                self.max_records = max(1, min(self.max_records, len(ids)) // 2)
                self._resend(ids, "frame_rejected")
            elif ack.frame_reject in RESENDABLE_REJECTS:
                self._resend(ids, "frame_rejected")
            else:
                self._fail_ids(
                    ids, pb.STATUS_INTERNAL, f"gateway refused the frame: {ack.frame_reject_detail}"
                )
            return
        accepted = [*ack.accepted_ids, *ack.duplicate_ids]
        for rid in accepted:
            entry = self.outstanding.get(rid)
            if entry is not None:
                entry.accepted = True
                entry.epoch = carrier.epoch
        if accepted:
            self._on_accepted(list(accepted))
        now = self._clock()
        for nack in ack.nacks:
            self.stats.nacks[labels.NACK.get(nack.reason, "other") if nack.reason else "other"] += 1
            if nack.reason in RETRYABLE_NACKS:
                self._resend(
                    [nack.request_id],
                    "nack_overloaded" if nack.reason == pb.NACK_REASON_OVERLOADED else "nack_draining",
                    not_before=now + nack.retry_after_ms / 1000,
                )
            elif self.outstanding.pop(nack.request_id, None) is not None:
                self._finish(
                    pb.InferResponse(
                        request_id=nack.request_id,
                        status=FINAL_NACK_STATUS.get(nack.reason, pb.STATUS_INTERNAL),
                        error_message=nack.detail,
                    )
                )

    def _fail_ids(self, ids: Iterable[bytes], status: pb.Status.ValueType, message: str) -> None:
        for rid in ids:
            if self.outstanding.pop(rid, None) is not None:
                self._finish(pb.InferResponse(request_id=rid, status=status, error_message=message))

    def _on_gateway_response(self, response: pb.InferResponse) -> None:
        entry = self.outstanding.get(response.request_id)
        if entry is None:
            self.stats.duplicate_responses += 1
            return
        if response.status in (pb.STATUS_OVERLOADED, pb.STATUS_UNAVAILABLE):
            retry_at = self._clock() + response.retry_after_ms / 1000
            entry.accepted = False
            self._resend([response.request_id], "retryable_status", not_before=retry_at)
            return
        del self.outstanding[response.request_id]
        self._finish(response)

    def _on_pong(self, carrier: Carrier, pong: pb.Pong) -> None:
        now = self._clock()
        rtt = max(0.0, (now_unix_us() - pong.ping_sent_at_unix_us) / 1e6)
        carrier.rtt_s = rtt if not carrier.rtt_s else 0.2 * rtt + 0.8 * carrier.rtt_s
        carrier.last_pong = now
        carrier.draining = pong.draining
        if carrier.epoch and pong.gateway_epoch != carrier.epoch:
            self._gateway_restarted(carrier.epoch)
        carrier.epoch = pong.gateway_epoch
        # Each Pong resets the records bound (a split after an oversized frame is temporary).
        self.max_records = min(self._config.batching.max_records, pong.limits.max_records or 1 << 30)
        self.max_frame_bytes = pong.limits.max_frame_bytes
        self._negotiate_dictionary(carrier, pong)
        self._wake.set()

    def _negotiate_dictionary(self, carrier: Carrier, pong: pb.Pong) -> None:
        """Use the gateway's preferred dictionary once held; fetch it from the gateway if not."""
        preferred = pong.preferred_dict_id
        store = self._codec.dictionaries
        if preferred and preferred in store:
            self.dict_id = preferred
        elif preferred and self._clock() >= self._dict_requested.get(preferred, 0.0):
            # Ask (again after 5 s without an answer: a request or its response may have been lost).
            frames = self._codec.encode(
                pb.DictionaryRequest(dict_id=preferred),
                agent_id=self._config.name,
                region=self._config.region,
            )
            if send_nowait(carrier.sock, frames):
                self._dict_requested[preferred] = self._clock() + 5.0
                while len(self._dict_requested) > 16:
                    del self._dict_requested[next(iter(self._dict_requested))]
        if self.dict_id and self.dict_id not in pong.dict_ids:
            self.dict_id = 0  # the gateway no longer decodes it

    def _on_dictionary(self, response: pb.DictionaryResponse) -> None:
        if not response.dictionary:
            return
        try:
            held = self._codec.dictionaries.add(response.dictionary, prefer=False)
        except DictionaryError as exc:
            log.warning("dictionary from the gateway refused", error=str(exc))
            return
        if held != response.dict_id:
            log.warning("dictionary id mismatch", announced=response.dict_id, inside=held)
            return
        log.info("dictionary fetched from the gateway", dict_id=held)

    def _gateway_restarted(self, old_epoch: int) -> None:
        """The gateway lost its in-memory work: resend what it had accepted and not answered."""
        lost = [rid for rid, e in self.outstanding.items() if e.accepted and e.epoch == old_epoch]
        for rid in lost:
            self.outstanding[rid].accepted = False
        self.stats.re_executions += len(lost)
        log.warning("gateway restarted; resending accepted work", requests=len(lost))
        self._resend(lost, "gateway_restarted")

    # ------------------------------------------------------------------ timers

    async def _pinger(self) -> None:
        nonce = 0
        while True:
            for carrier in list(self.carriers.values()):
                nonce += 1
                frames = self._codec.encode(
                    pb.Ping(nonce=nonce, dict_ids=self._codec.dictionaries.ids()),
                    agent_id=self._config.name,
                    region=self._config.region,
                )
                send_nowait(carrier.sock, frames)  # dropped while the carrier is not connected
            await asyncio.sleep(self._up.ping_interval_s)

    async def _watchdog(self) -> None:
        """Resend frames whose Ack is overdue or whose carrier died; expire outstanding past deadline."""
        while True:
            await asyncio.sleep(min(0.1, self._up.ping_interval_s))
            try:
                self._check_timers()
            except Exception:  # never let a callback error end the watchdog
                log.exception("uplink watchdog failed")

    def _check_timers(self) -> None:
        now = self._clock()
        for name, carrier in self.carriers.items():
            if carrier.last_pong and not carrier.alive(now, self._up.dead_after_s):
                self._resend_frames_of(name, "carrier_down")
        for message_id, frame in list(self._frames.items()):
            if now - frame.sent_at > self._up.ack_timeout_s:
                del self._frames[message_id]
                self._resend(
                    [r for r in frame.ids if r in self.outstanding and not self.outstanding[r].accepted],
                    "ack_timeout",
                )
        wall = now_unix_us()
        for rid in [
            r
            for r, e in self.outstanding.items()
            if e.request.deadline_unix_us and e.request.deadline_unix_us <= wall
        ]:
            self._expire(rid)
