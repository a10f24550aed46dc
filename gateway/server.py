"""The gateway daemon's lifecycle, in one class: start -> serve until told to stop -> drain -> close.

``Gateway.serve(stop)`` starts every component, waits for ``stop``, then drains: carrier health goes
DRAINING at once (GeoDNS and BGP move new traffic away), new requests are nacked DRAINING, queued work is
handed back as retryable, in-flight batches finish within ``drain_timeout_s``, replies are flushed, and
only then are the sockets closed. ``aclose()`` is safe before ``start()`` and safe twice.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio

import gateway.backends.builtin  # noqa: F401  (registers the built-in backend types)
from edgewire import CodecLimits, DictionaryStore, FrameCodec
from edgewire.extras import optional_dependency
from gateway.capture.recorder import CaptureRecorder
from gateway.capture.redact import Redactor
from gateway.config import GatewayConfig, load_config
from gateway.dispatch.batch_limits import batch_limit_warnings
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.cpu import CpuStage
from gateway.dispatch.pool import PoolDispatcher
from gateway.dispatch.work import WorkItem
from gateway.ingest import Ingest
from gateway.ingress.auth import (
    AgentAuthenticator,
    AgentDirectory,
    KeyFileError,
    curve_options,
    load_directory,
    load_server_keys,
)
from gateway.ingress.carrier import Carrier, CarrierIngress
from gateway.ops.health import CarrierHealth, HealthSnapshot
from gateway.ops.http import HealthServer, admin_token_of
from gateway.ops.metrics import CloseErrorReason, GatewayMetrics
from gateway.ops.notify import SystemdNotifier, watchdog
from gateway.replies import ReplyRouter
from gateway.shards.link import ShardLink, ShardRole
from gateway.shards.placement import cores, default_workers, per_shard_concurrency
from inference.backends.base import Backend, HealthChecked, Rescanning, create
from inference.pipeline.registry import PipelineDeclarations
from routing.geo import RegionResolver
from routing.holder import PolicyHolder
from routing.types import Tier
from service.logs import LogSettings
from service.runtime import collect_young_less_often, freeze_startup_objects

with optional_dependency("gateway"):
    import geoip2.database

log = structlog.get_logger("gateway")


class StartPhases:
    """How long each step of :meth:`Gateway.start` took, for the 'gateway ready' log line
    (``startup_ms``; with ``before_s``, the CLI's time from exec to the start, as ``exec_to_start``)."""

    def __init__(self, before_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self.ms: dict[str, float] = {}
        if before_s is not None:
            self.ms["exec_to_start"] = round(before_s * 1000, 1)

    def mark(self, phase: str) -> None:
        """``phase`` ended now: it took the time since the previous mark."""
        now = self._clock()
        self.ms[phase] = round((now - self._last) * 1000, 1)
        self._last = now


def process_age_s() -> float | None:
    """Seconds since this process was exec'd (Linux ``/proc/self/stat``), else None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class GatewayStartError(RuntimeError):
    """A component could not start (a carrier address in use, a backend without models, bad keys)."""


class Gateway:
    """One hk-gateway process."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        config_path: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        notifier: SystemdNotifier | None = None,
        shard: ShardRole | None = None,
    ) -> None:
        """``config_path`` and ``overrides`` (the command line's) are what a reload reads again. ``shard``:
        this process is one of the front's shards (gateway/shards): its carriers are views of the link to
        the front, which owns the sockets, ZAP, health and metrics endpoints."""
        self.config = config
        self.shard = shard
        self._link: ShardLink | None = None
        self._directory: AgentDirectory | None = None
        self.config_path = config_path
        self._overrides = dict(overrides or {})
        self.notifier = notifier or SystemdNotifier()
        self.metrics = GatewayMetrics(models=config.routing.models)
        self.policy = PolicyHolder(config.routing)
        self._logging = LogSettings(config.logging)  # SIGHUP may change it
        self.draining = False
        self.carriers: dict[str, Carrier] = {}
        self.pools: dict[str, PoolDispatcher] = {}
        self.backends: dict[str, Backend] = {}
        self.metrics.read_counters(
            "backend_rescan_failures",
            "Periodic model repository rescans that failed (the loaded models stay served)",
            "backend",
            lambda: {n: b.rescan_failures for n, b in self.backends.items() if isinstance(b, Rescanning)},
        )
        self.metrics.read_counters(
            "backend_check_failures",
            "Remote server checks that failed (the backend is NOT_SERVING until one succeeds)",
            "backend",
            lambda: {n: b.refresh_failures for n, b in self.backends.items() if isinstance(b, HealthChecked)},
        )
        self.ingest: Ingest | None = None
        self.http: HealthServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: AgentAuthenticator | None = None
        self.cpu: CpuStage | None = None
        self.capture: CaptureRecorder | None = None
        self._tasks: list[asyncio.Task[None]] = []
        health = config.health
        self._carrier_health = CarrierHealth(
            [c.name for c in config.carriers], health.rise, health.fall, health.stall_s
        )
        self._snapshot = self._carrier_health.initial()
        self._started = False
        self._closed = False
        self._geoip: geoip2.database.Reader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exec_to_start_s: float | None = None  # set by the CLI: imports and config, for the start log

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        phases = StartPhases(self.exec_to_start_s)
        try:
            admin_token = self._admin_token()  # a bad file fails before any slow backend start
            for warning in batch_limit_warnings(cfg):  # what check-config says, for who never ran it
                log.warning("pool batches more than a model takes", detail=warning)
            cpu = await self._start_backends_and_cpu()
            phases.mark("backends_and_cpu_workers")
            self._ctx = zmq.asyncio.Context()
            limits = CodecLimits(
                max_header_bytes=cfg.limits.max_header_bytes,
                max_frame_bytes=cfg.limits.max_frame_bytes,
                max_decompressed_bytes=cfg.limits.max_decompressed_bytes,
                max_records=cfg.limits.max_records,
            )
            dictionaries = DictionaryStore()
            if cfg.dictionaries is not None:
                dictionaries.load_dir(cfg.dictionaries)
            codec = FrameCodec(limits, dictionaries)
            try:
                security = self._start_security()
            except (KeyFileError, OSError) as exc:
                raise GatewayStartError(f"security: {exc}") from exc
            replies = ReplyRouter(self.carriers, codec, cfg.replies, self.metrics, cfg.instance)
            self.capture = self._capture_recorder(dictionaries, limits)
            self.capture.start()
            ingest = self.ingest = Ingest(
                cfg,
                codec,
                self.policy,
                self.pools,
                replies,
                self.metrics,
                self._regions(),
                self._auth or self._directory,
                capture=self.capture,
            )
            routing_pools = {p.name: p for p in cfg.routing.pools}
            # One breaker per backend, shared by every pool on it: a failing server is out for all of them.
            breakers = {
                name: CircuitBreaker(
                    cfg.breaker.failure_threshold, cfg.breaker.open_s, cfg.breaker.half_open_calls
                )
                for name in self.backends
            }
            declarations = PipelineDeclarations(cfg.pipelines)  # one for every pool
            for name, dispatch in cfg.pools.items():
                pool_cfg = routing_pools[name]
                self.pools[name] = PoolDispatcher(
                    name,
                    dispatch,
                    self.backends[dispatch.backend],
                    breakers[dispatch.backend],
                    max_queue_depth=pool_cfg.max_queue_depth,
                    concurrency=per_shard_concurrency(pool_cfg.concurrency, self._shard_count),
                    metrics=self.metrics,
                    cpu=cpu,
                    respond=ingest.respond,
                    respond_ok=ingest.respond_ok,
                    reroute=ingest.reroute,
                    observe=self._observe_latency,
                    pipelines=declarations,
                    after_realtime=ingest.after_realtime,
                )
                self.pools[name].start()
            phases.mark("pools")
            self._start_carriers(ingest, security)
            phases.mark("carriers")
            self._evaluate_health()
            http = self._start_http(admin_token) if self.shard is None else None
            self._background(self._health_loop(), "health")
            if self.notifier.watchdog_s:
                self._background(watchdog(self.notifier), "watchdog")
            phases.mark("http")
        except BaseException:
            await self.aclose()
            raise
        self.notifier.notify("READY=1")
        log.info(
            "gateway ready" if self.shard is None else "shard ready",
            instance=cfg.instance,
            carriers={n: c.endpoint for n, c in self.carriers.items()},
            http_port=None if http is None else http.port,
            pools=sorted(self.pools),
            startup_ms=phases.ms,
        )

    async def _start_backends_and_cpu(self) -> CpuStage:
        """The backends and the CPU workers, started together: both wait on other threads and processes
        (ONNX Runtime's sessions, the forkserver's imports), not on this loop."""
        cfg = self.config
        self.cpu = CpuStage(
            cfg.cpu.workers or default_workers(cores(), self._shard_count),
            cfg.cpu.mode,
            self.metrics,
            inline_max_requests=cfg.cpu.inline_max_requests,
            arena_slots=cfg.cpu.arena_slots,
            arena_slot_bytes=cfg.cpu.arena_slot_mb << 20,
            task_timeout_s=cfg.cpu.task_timeout_s,
            logging=cfg.logging,
        )
        self.cpu.start()
        started = await asyncio.gather(self._start_backends(), self.cpu.warm_up(), return_exceptions=True)
        for outcome in started:  # both are waited for, so that neither is left running unseen
            if isinstance(outcome, BaseException):
                raise outcome
        return self.cpu

    def _start_carriers(self, ingest: Ingest, security: dict[int, object] | None) -> None:
        """A ROUTER per carrier; in a shard, the carriers' views of the link to the front instead."""
        cfg = self.config
        assert self._ctx is not None
        if self.shard is not None:
            self._link = ShardLink(
                self._ctx,
                self.shard,
                [c.name for c in cfg.carriers],
                cfg.zmq,
                self.metrics,
                ingest.on_message,
                self._on_command,
            )
            self._link.start()
            self.carriers.update(self._link.carriers)
            return
        for carrier_cfg in cfg.carriers:
            carrier = CarrierIngress(
                carrier_cfg, self._ctx, cfg.zmq, cfg.limits, self.metrics, ingest.on_message, security
            )
            try:
                carrier.start()
            except zmq.ZMQError as exc:
                raise GatewayStartError(
                    f"carrier {carrier_cfg.name}: cannot bind {carrier_cfg.bind}: {exc}"
                ) from exc
            self.carriers[carrier_cfg.name] = carrier

    @property
    def _shard_count(self) -> int:
        return 1 if self.shard is None else self.shard.count

    def _on_command(self, command: Mapping[str, Any]) -> None:
        """An admin command the front passed on (gateway/shards/link.py)."""
        if "capture_s" in command:
            self._set_capture(float(command["capture_s"]))

    def _capture_recorder(self, dictionaries: DictionaryStore, limits: CodecLimits) -> CaptureRecorder:
        cfg = self.config.capture
        if self.shard is not None:  # each shard its own files, the disk bound shared out among them
            cfg = cfg.model_copy(
                update={
                    "directory": str(Path(cfg.directory) / f"shard-{self.shard.index}"),
                    "max_total_bytes": max(1 << 16, cfg.max_total_bytes // self.shard.count),
                }
            )
        redactor = None
        if cfg.redact:
            try:
                key = Path(cfg.redact_key_file).read_bytes() if cfg.redact_key_file else os.urandom(32)
                redactor = Redactor(key, dictionaries, limits)
            except (OSError, ValueError) as exc:
                raise GatewayStartError(f"capture: redaction key: {exc}") from exc
        return CaptureRecorder(
            cfg,
            instance=self.config.instance,
            dictionaries=lambda: [(i, dictionaries.raw(i) or b"") for i in dictionaries.ids()],
            metrics=self.metrics,
            redactor=redactor,
        )

    def _set_capture(self, seconds: float) -> float:
        """Admin endpoint (HTTP thread): capture for ``seconds`` (0 = stop); returns when it ends (Unix)."""
        if self.capture is None:
            return 0.0
        if seconds <= 0:
            self.capture.disable()
            return 0.0
        return self.capture.enable_for(seconds)

    async def _start_backends(self) -> None:
        for name, section in self.config.backends.items():
            options = {k: v for k, v in section.items() if k != "type"}
            try:
                backend = create(section["type"], name, options)
            except (ValueError, KeyError) as exc:
                raise GatewayStartError(f"backends.{name}: {exc}") from exc
            self.backends[name] = backend
            try:
                await backend.start()
            except Exception as exc:
                raise GatewayStartError(f"backends.{name}: failed to start: {exc}") from exc

    def _regions(self) -> RegionResolver:
        """Regions from agent keys, else from the peer address through the configured MaxMind database."""
        path = self.config.routing.geoip_db
        if path is None:
            return RegionResolver()
        try:
            self._geoip = geoip2.database.Reader(path)
        except (OSError, ValueError) as exc:
            raise GatewayStartError(f"routing.geoip_db: cannot open {path}: {exc}") from exc
        return RegionResolver(self._geoip)

    def _start_security(self) -> dict[int, object] | None:
        sec = self.config.security
        if sec.mode != "curve":
            return None
        assert sec.server_secret_key is not None
        assert sec.authorized_agents is not None
        if self.shard is not None:  # the front runs ZAP; a shard checks the User-Id it passes on
            self._directory = AgentDirectory(load_directory(sec.authorized_agents))
            return None
        public, secret = load_server_keys(sec.server_secret_key)
        assert self._ctx is not None
        self._auth = AgentAuthenticator(
            self._ctx,
            load_directory(sec.authorized_agents),
            self.metrics,
            [c.name for c in self.config.carriers],
        )
        self._auth.start()
        return curve_options(public, secret)

    # ------------------------------------------------------------------ serve, drain, close

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then drain and close."""
        await self.start()
        log.info("start-up objects frozen", objects=freeze_startup_objects())
        collect_young_less_often()
        try:
            await stop.wait()
            await self.drain()
        finally:
            await self.aclose()

    async def drain(self) -> None:
        """Stop taking work, hand queued work back, finish in-flight work within the drain deadline."""
        if self.draining:
            return
        self.draining = True
        self.notifier.notify("STOPPING=1")
        self.metrics.draining.set(1)
        if self.ingest is not None:
            self.ingest.draining = True
        self._evaluate_health()
        self._report_status()
        log.info("draining", deadline_s=self.config.drain_timeout_s, grace_s=self.config.drain_grace_s)
        if self.config.drain_grace_s:
            await asyncio.sleep(self.config.drain_grace_s)
        # One deadline for what follows: frames still being decompressed off the loop (their requests are
        # answered, as draining), then the batches in flight.
        deadline = time.monotonic() + self.config.drain_timeout_s
        if self.ingest is not None and not await self.ingest.settle(self.config.drain_timeout_s):
            log.warning("frames still inflating at the drain deadline; dropped unacknowledged")
        handed_back = 0
        for pool in self.pools.values():
            items = pool.take_queued()
            handed_back += len(items)
            if self.ingest is not None:
                self.ingest.hand_back(items, "gateway draining: resend elsewhere")
        await asyncio.gather(*(p.stop(max(0.0, deadline - time.monotonic())) for p in self.pools.values()))
        if self.ingest is not None:
            self.ingest.flush_replies()
        log.info("drained", handed_back=handed_back)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._end_tasks()
        if self.ingest is not None:
            self.ingest.close()
        for pool in self.pools.values():
            await pool.stop(0)
        if self.http is not None:
            self.http.stop()
        for carrier in self.carriers.values():
            await carrier.close()
        if self._link is not None:
            self._link.close()
        if self._auth is not None:
            self._auth.stop()
        await self._close_backends()
        if self.cpu is not None:
            self.cpu.close()
        if self.capture is not None:
            await asyncio.to_thread(self.capture.close)
        if self._geoip is not None:
            self._geoip.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _background(self, body: Coroutine[Any, Any, None], name: str) -> None:
        """Run a background loop; if it ever ends with an error, say so at once (not only at close).

        The health loop's death leaves /readyz on a stale snapshot (503 within seconds) and the watchdog's
        lets systemd restart the service: both show, but only this log line and counter say why.
        """
        task = asyncio.create_task(body, name=name)
        task.add_done_callback(self._background_ended)
        self._tasks.append(task)

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("background task failed", task=task.get_name(), exc_info=error)
            self.metrics.background_task_failures.labels(task.get_name()).inc()

    async def _end_tasks(self) -> None:
        """Cancel the background tasks; one that had died with an error is logged and counted."""
        for task in self._tasks:
            task.cancel()
        ended = await asyncio.gather(*self._tasks, return_exceptions=True)
        for task, result in zip(self._tasks, ended, strict=True):
            if isinstance(result, Exception):  # not CancelledError (a BaseException): the task had died
                log.error("background task had failed", task=task.get_name(), exc_info=result)
                self.metrics.close_errors.labels(task.get_name(), CloseErrorReason.TASK_FAILED).inc()

    async def _close_backends(self) -> None:
        """Close every backend; one that fails to is logged and counted, and the rest still close."""
        for name, backend in self.backends.items():
            try:
                await backend.aclose()
            except Exception as exc:
                log.error("backend close failed", backend=name, exc_info=exc)
                self.metrics.close_errors.labels(name, CloseErrorReason.BACKEND_CLOSE_FAILED).inc()

    # ------------------------------------------------------------------ reload (SIGHUP)

    def reload(self) -> bool:
        """Re-read the config file: routing policy and allowed agent keys change, traffic keeps flowing."""
        try:  # read and validate everything first, so a reload applies whole or not at all
            fresh = load_config(self.config_path, overrides=self._overrides)
            agents = None
            if (self._auth or self._directory) is not None and fresh.security.authorized_agents is not None:
                agents = load_directory(fresh.security.authorized_agents)
        except Exception as exc:  # noqa: BLE001  (any reload failure keeps the running config)
            self.metrics.reloads.labels("failed").inc()
            log.error("reload failed; keeping the running config", error=str(exc))
            return False
        if self.ingest is not None:
            # Frames read before the reload are served under the keys and policy they were read with.
            self.ingest.backlog.serve_all()
        changed = self.policy.apply(fresh.routing)
        for pool_cfg in fresh.routing.pools:  # the queues keep the bounds routing now reads
            pool = self.pools.get(pool_cfg.name)
            if pool is not None:
                pool.resize(
                    pool_cfg.max_queue_depth, per_shard_concurrency(pool_cfg.concurrency, self._shard_count)
                )
        if agents is not None:
            for directory in (self._auth, self._directory):
                if directory is not None:
                    directory.replace(agents)
            if self.ingest is not None:  # a revoked key's frames meet the identity checks again, not a hold
                self.ingest.release_holds()
        logging_changed = self._logging.apply(fresh.logging)  # e.g. debug for a while, without a restart
        self.metrics.reloads.labels("ok").inc()
        log.info(
            "reloaded",
            policy_changed=changed,
            generation=self.policy.generation,
            logging_changed=logging_changed,
        )
        return True

    def _observe_latency(self, item: WorkItem, service_s: float) -> None:
        policy, pool = self.policy.policy, item.decision.pool
        if pool is not None and policy.routes_to(pool):
            policy.observe(item.model, item.decision, service_s)

    def _admin_token(self) -> str | None:
        try:
            return admin_token_of(self.config.http.admin_token_file)
        except ValueError as exc:
            raise GatewayStartError(str(exc)) from exc

    def _start_http(self, admin_token: str | None) -> HealthServer:
        """Health, metrics and admin routes on their own thread (gateway/ops/http.py)."""
        cfg = self.config
        self.http = http = HealthServer(
            cfg.http.host,
            cfg.http.port,
            lambda: self._snapshot,
            self.metrics,
            self._set_carrier_enabled_threadsafe,
            stale_after_s=max(2.0, 4 * cfg.health.interval_s),
            set_capture=self._set_capture,
            admin_token=admin_token,
        )
        try:
            http.start()
        except OSError as exc:
            raise GatewayStartError(f"http: cannot listen on {cfg.http.host}:{cfg.http.port}: {exc}") from exc
        return http

    # ------------------------------------------------------------------ health

    def _tier_health(self, now: float) -> dict[str, bool]:
        tiers: dict[str, bool] = {}
        for pool_cfg in self.config.routing.pools:
            if pool_cfg.tier is Tier.EDGE_DEVICE:
                continue
            pool = self.pools.get(pool_cfg.name)
            healthy = pool is not None and pool.healthy(now)
            self.metrics.pool_healthy.labels(pool_cfg.name).set(1 if healthy else 0)
            tiers[pool_cfg.tier.value] = tiers.get(pool_cfg.tier.value, False) or healthy
        return tiers

    def _evaluate_health(self) -> None:
        now = time.monotonic()
        tiers = self._tier_health(now)
        states, details = self._carrier_health.evaluate(
            self.carriers, now, draining=self.draining, degraded=not all(tiers.values())
        )
        for name, state in states.items():
            self.metrics.carrier_up.labels(name).set(state.gauge)
        ready = bool(tiers) and all(tiers.values()) and any(c.bound for c in self.carriers.values())
        self.metrics.ready.set(1 if ready and not self.draining else 0)
        self._snapshot = HealthSnapshot(
            now, states, details, ready=ready and not self.draining, draining=self.draining, tiers=tiers
        )

    async def _health_loop(self) -> None:
        while True:
            self._report_status()
            await asyncio.sleep(self.config.health.interval_s)
            self._evaluate_health()

    def _report_status(self) -> None:
        """A shard tells the front how it is, every health interval (the front's sign that it lives)."""
        if self._link is not None:
            snap = self._snapshot
            self._link.send_status(
                {
                    "ready": snap.ready,
                    "tiers": dict(snap.tiers),
                    "draining": snap.draining,
                    "pid": os.getpid(),
                }
            )

    @property
    def snapshot(self) -> HealthSnapshot:
        return self._snapshot

    @property
    def disabled_carriers(self) -> frozenset[str]:
        """Carriers an operator disabled (POST /admin/carriers/<name>/disable), in memory only."""
        return frozenset(self._carrier_health.disabled)

    def set_carrier_enabled(self, name: str, enabled: bool) -> bool:
        if not self._carrier_health.set_enabled(name, enabled):
            return False
        self._evaluate_health()
        return True

    def _set_carrier_enabled_threadsafe(self, name: str, enabled: bool) -> bool:
        if not self._carrier_health.knows(name) or self._loop is None:
            return False
        self._loop.call_soon_threadsafe(self.set_carrier_enabled, name, enabled)
        return True

    def endpoint(self, carrier: str) -> str:
        """The address a carrier actually bound (useful with port ``*``)."""
        return self.carriers[carrier].endpoint
