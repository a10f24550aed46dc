"""The edge agent's lifecycle and data path: intake -> local tier -> spool -> batch -> uplink -> replies.

Local services send requests to the intake (``EdgeClient``). The shared routing policy decides: edge-device
requests are answered here; the rest go to Hong Kong. Interactive and batch requests are written to the
spool before the caller is acknowledged and leave it only when the gateway has accepted them; a realtime
request whose deadline cannot cover the round trip is served locally where a model exists, else failed
fast. ``aclose()`` is safe before ``start()`` and safe twice.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
import zmq
import zmq.asyncio
import zmq.auth

from edge_agent.config import AgentConfig, load_config
from edge_agent.discovery import CarrierEndpoint, Discovered, GatewayDiscovery, parse_nameserver
from edge_agent.local import LocalTier
from edge_agent.ops import AgentHttp
from edge_agent.spool import GroupCommit, Spool
from edge_agent.uplink import Uplink, send_nowait
from edgewire import DictionaryStore, FrameCodec, FrameError, is_valid_id, labels, new_id, now_unix_us, pb
from inference.profile import profile_of, wire_priority
from routing.holder import PolicyHolder
from routing.types import Priority, Tier
from service.logs import LogSettings

log = structlog.get_logger("edge_agent")
LOCAL_MAX_BATCH = 32
LOCAL_LINGER_S = 0.002
MAX_RESPONSES_PER_FRAME = 256  # answers to one local caller per intake frame
MAX_FRAMES_TAKING = 64
"""Intake frames being taken at once (spooled, waiting for their fsync); the intake reads no more until
one is done, so local services feel the disk's pace."""


FAIL_FAST_REASONS: Final = {
    "round_trip": "realtime deadline shorter than the round trip to HK",
    "local_busy": "deadline passed before the local model was free",
}
"""Why a request was answered DEADLINE_EXCEEDED without being tried: metric label -> caller's message."""


@dataclass
class AgentStats:
    received: int = 0
    local: int = 0
    remote: int = 0
    failed_fast: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(FAIL_FAST_REASONS, 0)))
    refused: int = 0  # nacked at intake: spool full or in-flight window full
    orphan_responses: int = 0  # answers for callers that left (e.g. recovered from the spool)
    orphan_acks: int = 0  # Acks a local caller was not reading (its socket full)
    responses: Counter[str] = field(default_factory=Counter)  # answers given to callers, by status


class EdgeAgent:
    """One edge-agent process for one region."""

    def __init__(self, config: AgentConfig, *, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.config = config
        self._curve = curve
        self.policy = PolicyHolder(config.routing)
        self._logging = LogSettings(config.logging)  # SIGHUP may change it
        self.stats = AgentStats()
        self.local: LocalTier | None = None
        self.spool: Spool | None = None
        self.uplink: Uplink | None = None
        self.http: AgentHttp | None = None
        self.discovery: GatewayDiscovery | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._intake: zmq.asyncio.Socket | None = None
        self._callers: dict[bytes, bytes] = {}  # request id -> intake routing id of the caller
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._stop = asyncio.Event()
        self._local_codec = FrameCodec()  # intake frames: loopback, uncompressed
        self._local_queue: dict[tuple[str, str], list[tuple[bytes, pb.InferRequest]]] = {}
        self._local_timers: dict[tuple[str, str], asyncio.TimerHandle] = {}
        # Hong Kong's answers are passed on per caller once per loop tick, as one intake frame each, and
        # their spool entries released in one call: the gateway sends up to 256 per frame.
        self._outbox: dict[bytes, list[pb.InferResponse]] = {}
        self._answered_ids: list[bytes] = []
        self._flush_scheduled = False
        self._commit: GroupCommit | None = None
        self._taking: set[asyncio.Task[None]] = set()  # intake frames being taken (waiting for an fsync)
        self._reserved = 0  # spooled requests counted against the in-flight window, not yet submitted

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.config
        try:
            self._ctx = zmq.asyncio.Context()
            dictionaries = DictionaryStore()
            if cfg.dictionaries is not None:
                dictionaries.load_dir(cfg.dictionaries)
            codec = FrameCodec(
                dictionaries=dictionaries, level=cfg.zstd_level, min_saving=cfg.zstd_min_saving
            )
            if cfg.local.enabled and cfg.local.repository.exists():
                self.local = LocalTier(cfg.local.repository, cfg.local.threads)
                await self.local.start()
            self.spool = Spool(
                cfg.spool.directory / cfg.name,
                segment_bytes=cfg.spool.segment_bytes,
                max_bytes=cfg.spool.max_bytes,
                fsync=cfg.spool.fsync,
                when_full=cfg.spool.when_full,
            )
            if cfg.spool.fsync == "batch":
                self._commit = GroupCommit(self.spool)
            curve = self._curve or self._load_keys()
            self.uplink = Uplink(cfg, codec, self._ctx, self._on_response, self._on_accepted, curve)
            self.uplink.set_endpoints([(c.name, c.endpoint) for c in cfg.carriers])
            self.uplink.start()
            self.discovery = self._new_discovery()
            if cfg.discovery.mode == "static":
                await self.discovery.resolve()  # no DNS: the configured list, counted like any answer
            else:
                self._tasks.append(asyncio.create_task(self._discover(self.discovery), name="discovery"))
            self._recover()
            self._intake = self._ctx.socket(zmq.ROUTER)
            self._intake.setsockopt(zmq.LINGER, 0)
            self._intake.bind(cfg.intake)
            self._tasks.append(asyncio.create_task(self._receive(), name="intake"))
            self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
            self.http = AgentHttp(self)
            await self.http.start(cfg.http.host, cfg.http.port)
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "edge agent ready",
            agent=cfg.name,
            region=cfg.region,
            intake=self.intake_endpoint,
            carriers=[c.endpoint for c in cfg.carriers],
            local_tier=self.local is not None,
        )

    async def _housekeeping(self) -> None:
        """Once a second: expired requests leave the spool (bounding its memory and disk)."""
        while True:
            await asyncio.sleep(1.0)
            if self.spool is not None:
                try:
                    self.spool.purge_expired()
                except OSError:
                    log.exception("spool purge failed")

    async def drain(self, timeout_s: float) -> int:
        """SIGTERM: take no new requests; wait (bounded) for answers to what is in flight. Returns the
        number still unanswered; spooled ones are resent by the next start."""
        if self._intake is not None:
            self._intake.setsockopt(zmq.RCVHWM, 1)
        for task in self._tasks:
            if task.get_name() == "intake":
                task.cancel()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            busy = (
                (self.uplink.inflight if self.uplink else 0)
                + sum(len(q) for q in self._local_queue.values())
                + len(self._taking)  # spooled, waiting for their fsync: they go out, then are answered
            )
            if not busy and all(t.done() for t in self._tasks if t.get_name() != "discovery"):
                return 0
            await asyncio.sleep(0.05)  # bounded poll of in-flight work
        return self.uplink.inflight if self.uplink else 0

    def reload(self, path: Path | None) -> bool:
        """SIGHUP: re-read the config file and apply its routing policy and logging; on any error keep the
        running ones."""
        try:
            fresh = load_config(path, overrides={"region": self.config.region})
            changed = self.policy.apply(fresh.routing)
        except Exception as exc:  # noqa: BLE001  (any reload failure keeps the running policy)
            log.error("reload failed; keeping the running config", error=str(exc))
            return False
        logging_changed = self._logging.apply(fresh.logging)
        log.info("reloaded", policy_changed=changed, logging_changed=logging_changed)
        return True

    def _load_keys(self) -> tuple[bytes, bytes, bytes] | None:
        """(agent public, agent secret, gateway public) from the certificate files, for CurveZMQ."""
        sec = self.config.security
        if sec.mode != "curve":
            return None
        assert sec.agent_secret_key is not None
        assert sec.gateway_public_key is not None
        public, secret = zmq.auth.load_certificate(sec.agent_secret_key)
        server, _ = zmq.auth.load_certificate(sec.gateway_public_key)
        if secret is None:
            raise ValueError(f"{sec.agent_secret_key}: holds no secret key")
        return public, secret, server

    def _new_discovery(self) -> GatewayDiscovery:
        d = self.config.discovery
        return GatewayDiscovery(
            d.name,
            mode=d.mode,
            port=d.port,
            nameservers=[parse_nameserver(ns) for ns in d.nameservers],
            static=[CarrierEndpoint(c.name, c.endpoint) for c in self.config.carriers],
            min_ttl_s=d.min_ttl_s,
            max_ttl_s=d.max_ttl_s,
            timeout_s=d.timeout_s,
        )

    async def _discover(self, discovery: GatewayDiscovery) -> None:
        """Follow the gateway's carrier addresses in DNS (respecting TTL); the static list is the fallback."""

        def changed(found: Discovered) -> None:
            assert self.uplink is not None
            self.uplink.set_endpoints([(e.name, e.endpoint) for e in found.endpoints])
            log.info(
                "gateway endpoints",
                source=found.source,
                ttl_s=found.ttl_s,
                error=found.error,
                endpoints=[e.endpoint for e in found.endpoints],
            )

        await discovery.watch(changed, self._stop)

    async def __aenter__(self) -> EdgeAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def intake_endpoint(self) -> str:
        if self._intake is None:
            return self.config.intake
        return self._intake.get_string(zmq.LAST_ENDPOINT)

    def _recover(self) -> None:
        """Resend what an earlier run spooled and the gateway never accepted."""
        assert self.spool is not None
        assert self.uplink is not None
        requests = []
        for _, payload, _ in self.spool.pending():
            request = pb.InferRequest.FromString(payload)
            requests.append(request)
        if requests:
            log.info("resending spooled requests", count=len(requests), skipped=dict(self.spool.drops))
            self.uplink.submit(requests)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for task in self._taking:  # what they spooled is resent by the next start
            task.cancel()
        await asyncio.gather(*self._taking, return_exceptions=True)
        for timer in self._local_timers.values():
            timer.cancel()
        self._local_timers.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
        if self.uplink is not None:
            await self.uplink.aclose()
        self._flush_responses()  # answers already received still reach their callers
        if self._commit is not None:
            self._commit.close()
        if self._intake is not None:
            self._intake.close(0)
        if self.local is not None:
            await self.local.aclose()
        if self.spool is not None:
            self.spool.close()
        if self._ctx is not None:
            self._ctx.term()

    # ------------------------------------------------------------------ intake

    async def _receive(self) -> None:
        """Read intake frames and take each at once; a frame whose requests wait for the spool's fsync
        finishes in a task of its own, so frames that arrive meanwhile are spooled and share the next
        fsync (at most ``MAX_FRAMES_TAKING`` waiting). Stopping the reading (drain) lets those finish."""
        assert self._intake is not None
        codec = FrameCodec()
        slots = asyncio.Semaphore(MAX_FRAMES_TAKING)
        while True:
            # The slot first: this loop is cancelled (drain) only where it awaits, and no await may come
            # between receiving a frame and taking it, or a received frame would be dropped unanswered.
            await slots.acquire()
            try:
                frames = await self._intake.recv_multipart()
            except BaseException:
                slots.release()
                raise
            waiting = self._take_frame(codec, frames)
            if waiting is None:
                slots.release()
                continue
            task = asyncio.create_task(waiting)
            self._taking.add(task)
            task.add_done_callback(self._taking.discard)
            task.add_done_callback(lambda _: slots.release())

    def _take_frame(self, codec: FrameCodec, frames: list[bytes]) -> Coroutine[Any, Any, None] | None:
        caller, body = frames[0], frames[1:]
        try:
            batch = codec.decode(body).payload
        except FrameError as exc:
            log.warning("bad frame from a local service", reason=exc.label)
            return None
        if not isinstance(batch, pb.RequestBatch):
            return None
        try:
            return self._take(caller, list(batch.requests))
        except Exception:  # one bad batch must not stop the intake for every local service
            log.exception("taking a batch from a local service failed")
            return None

    def _take(  # noqa: PLR0912, PLR0915  (one decision table)
        self, caller: bytes, requests: list[pb.InferRequest]
    ) -> Coroutine[Any, Any, None] | None:
        """Decide, spool, queue and send what a frame holds; the Ack goes back now, or, when requests of
        it wait for the spool's fsync, from the coroutine returned (the caller runs it)."""
        assert self.uplink is not None
        assert self.spool is not None
        cfg = self.config
        ack = pb.Ack(acked_message_id=new_id())
        local: defaultdict[tuple[str, str], list[pb.InferRequest]] = defaultdict(list)
        direct: list[pb.InferRequest] = []  # to Hong Kong now
        spooled: list[pb.InferRequest] = []  # to Hong Kong once the spool's fsync covers them
        policy = self.policy.policy
        wall = now_unix_us()
        rtt = self.uplink.rtt_s()
        for request in requests:
            self.stats.received += 1
            if not is_valid_id(request.request_id):
                request.request_id = new_id()
            elif request.request_id in self._callers or (
                self.uplink and self.uplink.knows(request.request_id)
            ):
                ack.nacks.append(
                    pb.Nack(
                        request_id=request.request_id,
                        reason=pb.NACK_REASON_INVALID_REQUEST,
                        detail="request id already used: every request needs a new id",
                    )
                )
                continue
            if not request.deadline_unix_us:
                # Nothing waits forever: a request without a deadline gets the configured default.
                request.deadline_unix_us = wall + int(cfg.default_deadline_s * 1e6)
            priority = wire_priority(request.priority)
            remaining = (request.deadline_unix_us - wall) / 1e6 if request.deadline_unix_us else None
            profile = profile_of(request, priority, remaining, cfg.region)
            decision = policy.tier_for(profile)
            can_local = self.local is not None and self.local.serves(
                request.model_name, request.model_version
            )
            if decision.tier is Tier.EDGE_DEVICE and can_local:
                local[(request.model_name, request.model_version)].append(request)
                continue
            if priority is Priority.REALTIME and remaining is not None:
                # The round trip to Hong Kong plus the estimated service time must fit the deadline.
                service = policy.estimator.service_time(profile, decision.score, decision.size_bucket)
                needed = (rtt if rtt is not None else float("inf")) + service
                if needed > remaining:
                    if can_local:
                        local[(request.model_name, request.model_version)].append(request)
                    else:
                        self._fail_fast(caller, request, "round_trip")
                    continue
            if not self.uplink.has_room(self._reserved + len(direct) + len(spooled) + 1):
                self._refuse(ack, request, "agent in-flight window full")
                continue
            if priority.value in cfg.spool.classes:
                try:
                    result = str(
                        self.spool.append(
                            request.request_id,
                            request.SerializeToString(),
                            request.deadline_unix_us / 1e6 if request.deadline_unix_us else 0.0,
                        )
                    )
                except OSError as exc:  # a full or failing disk: refuse (retryable), keep serving
                    log.error("spool write failed", error=str(exc))
                    result = "write_failed"
                if result != "stored":
                    self._refuse(ack, request, f"spool full ({result})")
                    continue
                spooled.append(request)
            else:
                direct.append(request)
            self._callers[request.request_id] = caller
        self._queue_local(caller, local)
        self._tasks = [t for t in self._tasks if not t.done()]
        self._accept(ack, direct)
        if spooled and self._commit is not None:
            # They wait for an fsync that covers them, holding their place in the in-flight window.
            self._reserved += len(spooled)
            return self._after_commit(caller, ack, spooled)
        self._accept(ack, spooled)
        self._reply(caller, ack)
        return None

    async def _after_commit(self, caller: bytes, ack: pb.Ack, spooled: list[pb.InferRequest]) -> None:
        """The rest of a frame whose spooled requests wait for an fsync: send them and the Ack after it."""
        assert self._commit is not None
        reserved = len(spooled)
        try:
            try:
                await self._commit.commit()
            except OSError as exc:
                self._take_back(ack, spooled, exc)
            else:
                self._accept(ack, spooled)
            finally:
                self._reserved -= reserved
            self._reply(caller, ack)
        except Exception:  # a bug here must not go unseen: the task is not awaited by anyone
            log.exception("taking a batch from a local service failed")

    def _accept(self, ack: pb.Ack, requests: list[pb.InferRequest]) -> None:
        """Hand requests to the uplink and list them as accepted in the caller's Ack."""
        if requests:
            assert self.uplink is not None
            self.uplink.submit(requests)
            self.stats.remote += len(requests)
            ack.accepted_ids.extend(r.request_id for r in requests)

    def _take_back(self, ack: pb.Ack, spooled: list[pb.InferRequest], exc: OSError) -> None:
        """The spool could not make ``spooled`` durable: refuse them (retryable) rather than acknowledge
        what a power loss could lose, and tombstone them so a restart does not resend them."""
        log.error("spool fsync failed; refusing the frame's spooled requests", error=str(exc))
        ids = [r.request_id for r in spooled]
        assert self.spool is not None
        try:
            self.spool.ack(ids)
        except OSError as again:  # the disk is failing: a restart may resend them, nobody waits for those
            log.error("spool tombstones failed", error=str(again))
        for request in spooled:
            self._callers.pop(request.request_id, None)
            self._refuse(ack, request, "spool fsync failed")

    def _queue_local(self, caller: bytes, local: dict[tuple[str, str], list[pb.InferRequest]]) -> None:
        for key, batch in local.items():
            queue = self._local_queue.setdefault(key, [])
            queue.extend((caller, request) for request in batch)
            if len(queue) >= LOCAL_MAX_BATCH:
                self._flush_local(key)
            elif key not in self._local_timers:
                # Micro-batching: requests from many callers share one model call.
                loop = asyncio.get_running_loop()
                self._local_timers[key] = loop.call_later(LOCAL_LINGER_S, self._flush_local, key)

    def _flush_local(self, key: tuple[str, str]) -> None:
        timer = self._local_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        batch = self._local_queue.pop(key, [])
        if batch:
            self._tasks.append(asyncio.create_task(self._serve_local(batch)))

    async def _serve_local(self, batch: list[tuple[bytes, pb.InferRequest]]) -> None:
        assert self.local is not None
        wall = now_unix_us()
        live = [(c, r) for c, r in batch if not r.deadline_unix_us or r.deadline_unix_us > wall]
        for caller, request in batch:
            if request.deadline_unix_us and request.deadline_unix_us <= wall:
                self._fail_fast(caller, request, "local_busy")
        if not live:
            return
        try:
            responses = await self.local.serve([r for _, r in live])
        except Exception:  # answer every caller; a local-tier bug must not leave them waiting
            log.exception("local tier failed")
            responses = [
                pb.InferResponse(
                    request_id=r.request_id,
                    status=pb.STATUS_INTERNAL,
                    error_message="local tier failed",
                    model_name=r.model_name,
                )
                for _, r in live
            ]
        self.stats.local += len(responses)
        by_caller: defaultdict[bytes, list[pb.InferResponse]] = defaultdict(list)
        for (caller, _), response in zip(live, responses, strict=True):
            by_caller[caller].append(response)
        for caller, answers in by_caller.items():
            self._send_responses(caller, answers)

    def _refuse(self, ack: pb.Ack, request: pb.InferRequest, detail: str) -> None:
        self.stats.refused += 1
        ack.nacks.append(
            pb.Nack(
                request_id=request.request_id,
                reason=pb.NACK_REASON_OVERLOADED,
                retry_after_ms=200,
                detail=detail,
            )
        )

    def _fail_fast(self, caller: bytes, request: pb.InferRequest, reason: str) -> None:
        """Answer DEADLINE_EXCEEDED now; ``reason`` is a FAIL_FAST_REASONS label."""
        self.stats.failed_fast[reason] += 1
        response = pb.InferResponse(
            request_id=request.request_id,
            status=pb.STATUS_DEADLINE_EXCEEDED,
            error_message=FAIL_FAST_REASONS[reason],
            model_name=request.model_name,
        )
        self._send_responses(caller, [response])

    def _reply(self, caller: bytes, ack: pb.Ack) -> None:
        """The Ack to a local caller, without waiting: a caller that does not read must not hold up the
        intake for every other (it gets no Ack, and its requests are answered or time out)."""
        if self._intake is None:
            return
        frames = self._local_codec.encode(
            ack, agent_id=self.config.name, region=self.config.region, compress=False
        )
        if not send_nowait(self._intake, [caller, *frames]):
            self.stats.orphan_acks += 1

    def _send_responses(self, caller: bytes, responses: list[pb.InferResponse]) -> None:
        """Answer a local caller now (non-blocking; loopback frames are not worth compressing)."""
        if self._intake is None or not responses:
            return
        for response in responses:
            self.stats.responses[labels.STATUS.get(response.status, "other")] += 1
        frames = self._local_codec.encode(
            pb.ResponseBatch(responses=responses),
            agent_id=self.config.name,
            region=self.config.region,
            compress=False,
        )
        if not send_nowait(self._intake, [caller, *frames]):  # the caller has gone (or is not reading)
            self.stats.orphan_responses += len(responses)

    # ------------------------------------------------------------------ uplink callbacks

    def _on_accepted(self, ids: list[bytes]) -> None:
        if self.spool is not None:
            self.spool.ack(ids)

    def _on_response(self, response: pb.InferResponse) -> None:
        caller = self._callers.pop(response.request_id, None)
        self._answered_ids.append(response.request_id)
        if caller is None:
            self.stats.orphan_responses += 1
        else:
            self._outbox.setdefault(caller, []).append(response)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_responses)

    def _flush_responses(self) -> None:
        """Release the answered requests' spool entries, then answer each caller in frames of at most
        ``MAX_RESPONSES_PER_FRAME``."""
        self._flush_scheduled = False
        answered, self._answered_ids = self._answered_ids, []
        outbox, self._outbox = self._outbox, {}
        if answered and self.spool is not None:
            try:
                self.spool.ack(answered)
            except OSError as exc:  # a failing disk must not keep the answers from their callers
                log.error("spool ack failed", error=str(exc))
        for caller, responses in outbox.items():
            for start in range(0, len(responses), MAX_RESPONSES_PER_FRAME):
                self._send_responses(caller, responses[start : start + MAX_RESPONSES_PER_FRAME])
