"""The edge agent's lifecycle: intake -> local tier -> spool -> uplink -> replies, started and stopped here.

Local services send requests to the intake (``EdgeClient``). The shared routing policy decides: edge-device
requests are answered here; the rest go to Hong Kong. Interactive and batch requests are written to the
spool, with who asked, before the caller is acknowledged and leave it once answered; a realtime
request whose deadline cannot cover the round trip is served locally where a model exists, else failed
fast. The parts: ``intake`` (the socket), ``admission`` (the decision table), ``local_batcher`` (the local
tier's micro-batches), ``spool``, ``uplink``, ``callers`` (Acks and answers), ``ops`` (health, metrics).

``serve(stop)`` runs the agent like the gateway's daemon: start -> wait for ``stop`` -> drain with a
deadline -> close. ``aclose()`` is safe before ``start()`` and safe twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Final

import structlog
import zmq
import zmq.asyncio
import zmq.auth

from edge_agent.admission import Admission
from edge_agent.callers import Callers
from edge_agent.config import AgentConfig, load_config
from edge_agent.discovery import CarrierEndpoint, Discovered, GatewayDiscovery, parse_nameserver
from edge_agent.errors import ErrorCounts, ErrorReason
from edge_agent.intake import Intake
from edge_agent.local_batcher import LocalBatcher
from edge_agent.ops import AgentHttp
from edge_agent.parked import ParkedAnswers
from edge_agent.spool import GroupCommit, Spool
from edge_agent.stats import FAIL_FAST_REASONS, AgentStats
from edge_agent.uplink import Uplink
from edgewire import DictionaryStore, FrameCodec, pb
from routing.holder import PolicyHolder
from service.logs import LogSettings

if TYPE_CHECKING:  # the local tier needs the agent-local extra (onnxruntime): imported only when enabled
    from edge_agent.local import LocalTier

__all__ = ["DRAIN_TIMEOUT_S", "FAIL_FAST_REASONS", "AgentStats", "EdgeAgent"]

log = structlog.get_logger("edge_agent")

DRAIN_TIMEOUT_S: Final = 10.0
"""How long ``serve`` waits, once stopped, for answers to what is in flight."""
SPOOL_PURGE_INTERVAL_S: Final = 1.0


class EdgeAgent:
    """One edge-agent process for one region.

    ``serve(stop)`` is the whole life; ``start``, ``drain`` and ``aclose`` are its steps, for callers
    that drive them one by one (tests, ``async with``). A closed agent does not start again.
    """

    def __init__(self, config: AgentConfig, *, curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.config = config
        self._curve = curve
        self.policy = PolicyHolder(config.routing)
        self._logging = LogSettings(config.logging)  # SIGHUP may change it
        self.stats = AgentStats()
        self.errors = ErrorCounts()
        self.local: LocalTier | None = None
        self.spool: Spool | None = None
        self.uplink: Uplink | None = None
        self.http: AgentHttp | None = None
        self.discovery: GatewayDiscovery | None = None
        self.intake: Intake | None = None
        self.callers: Callers | None = None
        self.batcher: LocalBatcher | None = None
        self.admission: Admission | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._commit: GroupCommit | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._stop = asyncio.Event()  # set by aclose: discovery's watch ends
        self._progress = asyncio.Event()  # in-flight work finished: the drain looks again

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, stop: asyncio.Event, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> int:
        """Start, run until ``stop`` is set, drain (at most ``drain_timeout_s``), close. Returns the
        requests still unanswered when the drain ended (spooled ones are resent by the next start)."""
        await self.start()
        try:
            await stop.wait()
            return await self.drain(drain_timeout_s)
        finally:
            await self.aclose()

    async def start(self) -> None:
        """Open the spool, connect the carriers, bind the intake and the HTTP port; resend what an
        earlier run spooled. On any failure what was opened is closed again and the error raised."""
        if self._closed:
            raise RuntimeError("this EdgeAgent was closed; make a new one")
        if self._started:
            return
        self._started = True
        try:
            await self._open()
        except BaseException:
            await self.aclose()
            raise
        log.info(
            "edge agent ready",
            agent=self.config.name,
            region=self.config.region,
            intake=self.intake_endpoint,
            carriers=[c.endpoint for c in self.config.carriers],
            local_tier=self.local is not None,
        )

    async def _open(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        dictionaries = DictionaryStore()
        if cfg.dictionaries is not None:
            dictionaries.load_dir(cfg.dictionaries)
        codec = FrameCodec(dictionaries=dictionaries, level=cfg.zstd_level, min_saving=cfg.zstd_min_saving)
        if cfg.local.enabled and cfg.local.repository.exists():
            from edge_agent.local import LocalTier

            self.local = LocalTier(cfg.local.repository, cfg.local.threads)
            await self.local.start()
        elif cfg.local.enabled:
            # Not an error (a node may get its models later), but never silent: every request then goes to
            # Hong Kong, and realtime ones that cannot make the round trip fail fast.
            log.warning(
                "local tier enabled but its model repository does not exist: no local tier",
                repository=str(cfg.local.repository),
            )
        self.spool = spool = Spool(
            cfg.spool.directory / cfg.name,
            segment_bytes=cfg.spool.segment_bytes,
            max_bytes=cfg.spool.max_bytes,
            fsync=cfg.spool.fsync,
            when_full=cfg.spool.when_full,
        )
        if cfg.spool.fsync == "batch":
            self._commit = GroupCommit(spool)
        parked = ParkedAnswers(cfg.replies.parked_answers, cfg.replies.parked_bytes)
        callers = Callers(self._send_to_caller, cfg.name, cfg.region, self.stats, self._release, parked)
        self.callers = callers
        curve = self._curve or self._load_keys()
        self.uplink = uplink = Uplink(cfg, codec, self._ctx, self._on_response, curve, errors=self.errors)
        uplink.set_endpoints([(c.name, c.endpoint) for c in cfg.carriers])
        uplink.start()
        self.discovery = self._new_discovery()
        if cfg.discovery.mode == "static":
            await self.discovery.resolve()  # no DNS: the configured list, counted like any answer
        else:
            self._tasks.append(asyncio.create_task(self._discover(self.discovery), name="discovery"))
        self._recover()
        if self.local is not None:
            self.batcher = LocalBatcher(self.local, callers, self.stats, self.errors, self._progress.set)
        self.admission = Admission(
            cfg, self.policy, uplink, spool, self._commit, self.batcher, callers, self.stats, self.errors
        )
        self.intake = Intake(self._ctx, cfg.intake, self.stats, self.errors, self._progress.set)
        self.intake.start(self.admission.take)
        self._tasks.append(asyncio.create_task(self._housekeeping(), name="housekeeping"))
        self.http = AgentHttp(self)
        await self.http.start(cfg.http.host, cfg.http.port)

    def busy(self) -> int:
        """Requests in flight: sent to Hong Kong and not answered, queued for or in the local tier, or
        spooled and waiting for their fsync (a frame's worth each)."""
        return (
            (self.uplink.inflight if self.uplink is not None else 0)
            + (self.batcher.busy if self.batcher is not None else 0)
            + (self.intake.taking if self.intake is not None else 0)
        )

    async def drain(self, timeout_s: float) -> int:
        """SIGTERM: take no new requests; wait (at most ``timeout_s``) for answers to what is in flight,
        waking as each piece finishes. Returns what is still unanswered (``busy()``)."""
        if self.intake is not None:
            await self.intake.stop_reading()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.busy():
            self._progress.clear()
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)
        left_over = self.busy()
        log.info("drained", unanswered=left_over)
        return left_over

    async def aclose(self) -> None:
        """Stop everything and release the ports, sockets and spool; safe before start, safe twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self.intake is not None:
            await self.intake.stop()
        if self.batcher is not None:
            await self.batcher.aclose()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
        if self.uplink is not None:
            await self.uplink.aclose()
        if self.callers is not None:
            self.callers.flush()  # answers already received still reach their callers
            self.callers.close()
        if self._commit is not None:
            self._commit.close()
        if self.intake is not None:
            self.intake.close()
        if self.local is not None:
            await self.local.aclose()
        if self.spool is not None:
            self.spool.close()
        if self._ctx is not None:
            self._ctx.term()

    async def __aenter__(self) -> EdgeAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def intake_endpoint(self) -> str:
        if self.intake is None:
            return self.config.intake
        return self.intake.endpoint

    def reload(self, path: Path | None) -> bool:
        """SIGHUP: re-read the config file and apply its routing policy and logging; on any error keep the
        running ones."""
        try:
            fresh = load_config(path, overrides={"region": self.config.region})
            changed = self.policy.apply(fresh.routing)
        except Exception as exc:  # noqa: BLE001  (any reload failure keeps the running policy)
            self.errors.count(ErrorReason.RELOAD)
            log.error("reload failed; keeping the running config", path=str(path), error=str(exc))
            return False
        logging_changed = self._logging.apply(fresh.logging)
        log.info("reloaded", policy_changed=changed, logging_changed=logging_changed)
        return True

    # ------------------------------------------------------------------ wiring

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

    def _recover(self) -> None:
        """Ask Hong Kong again for what an earlier run spooled and did not answer, for the callers that
        asked (the gateway's dedupe window answers what it ran already from its response cache)."""
        assert self.spool is not None
        assert self.uplink is not None
        assert self.callers is not None
        requests = []
        raws = []
        for record in self.spool.records():
            request = pb.InferRequest.FromString(record.payload)
            requests.append(request)
            raws.append(record.payload)
            self.callers.wait_for(record.request_id, record.caller, request.deadline_unix_us)
        if requests:
            log.info("resending spooled requests", count=len(requests), skipped=dict(self.spool.drops))
            self.uplink.submit(requests, raws)

    async def _housekeeping(self) -> None:
        """Expired requests leave the spool (bounding its memory and disk), a second after their deadline
        at most."""
        while True:
            await asyncio.sleep(SPOOL_PURGE_INTERVAL_S)
            if self.spool is not None:
                try:
                    self.spool.purge_expired()
                except OSError:
                    self.errors.count(ErrorReason.SPOOL_PURGE)
                    log.exception("spool purge failed")

    # ------------------------------------------------------------------ callbacks

    def _send_to_caller(self, frames: list[bytes]) -> bool:
        return self.intake is not None and self.intake.send(frames)

    def _on_response(self, response: pb.InferResponse) -> None:
        assert self.callers is not None
        self.callers.from_hong_kong(response)
        self._progress.set()

    def _release(self, answered: list[bytes]) -> None:
        """Answered requests leave the spool (a failing disk must not keep the answers from callers)."""
        if self.spool is not None:
            try:
                self.spool.ack(answered)
            except OSError as exc:
                self.errors.count(ErrorReason.SPOOL_ACK)
                log.error("spool ack failed", error=str(exc), requests=len(answered))
