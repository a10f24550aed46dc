"""The front: what systemd runs when ``shards`` > 1. It owns everything an agent, GeoDNS, BGP or Prometheus
sees of the gateway (the carriers' ROUTERs with CurveZMQ and ZAP, health, metrics, the admin routes, the
systemd watchdog) and none of the work: each agent frame goes, as it arrived, to the shard of its agent.

Per frame the front reads the agent id (ZAP's ``User-Id`` under CURVE, else the envelope's, one upb parse
of frame 0), picks the shard (placement.shard_of) and sends the frame's parts on the link without copying
them; a reply from a shard goes out on the carrier the shard names. Both run on one thread of their own
(gateway/shards/relay.py) once the carriers are bound; the event loop keeps health, metrics, the shards'
lives, ZAP and the watchdog. Frames for a shard that is not
connected (dead, restarting) are dropped and counted (``hkgw_shard_frames_dropped_total{reason}``): the
agent resends what was not acknowledged, and it reaches the same shard once it is back.

Health: a carrier is UP while its ROUTER passes traffic and every shard reports itself ready; DEGRADED
while some shard does not (dead, restarting, wedged) or a tier has no healthy pool; DOWN when no shard can
serve. A shard that stops reporting for ``wedged_after_s`` is killed and started again.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge

from edgewire import pb
from gateway.config import GatewayConfig, load_config
from gateway.ingress.auth import (
    AgentAuthenticator,
    KeyFileError,
    curve_options,
    load_directory,
    load_server_keys,
)
from gateway.ingress.carrier import CarrierIngress
from gateway.ingress.reader import EdgeReader
from gateway.ops.health import CarrierHealth, HealthSnapshot
from gateway.ops.http import HealthServer, admin_token_of
from gateway.ops.metrics import NS, GatewayMetrics
from gateway.ops.notify import SystemdNotifier, watchdog
from gateway.shards.holds import FrontHolds
from gateway.shards.link import (
    COMMAND,
    FRAME,
    METRICS,
    QUERY,
    STATUS,
    link_socket_options,
    shard_routing_id,
    tag,
)
from gateway.shards.merge import Retired, merge
from gateway.shards.placement import shard_of
from gateway.shards.relay import Relay
from gateway.shards.supervisor import ShardProcess, shard_command
from service.logs import LogSettings

log = structlog.get_logger("gateway.front")

START_TIMEOUT_S = 180.0
"""A shard's first start (backends, CPU workers) must report within this long, or the front gives up."""
SCRAPE_WAIT_S = 1.0
"""/metrics waits this long for every live shard's series; a shard that has not answered by then
contributes the last series it sent."""
FAILED_START_CODES = (
    2,
    3,
)  # gateway.cli's EXIT_CONFIG and EXIT_START: a config or start-up the shard refuses


class FrontStartError(RuntimeError):
    """The front could not start: a carrier address in use, bad keys, or a shard that cannot start."""


@dataclass
class _Shard:
    process: ShardProcess
    routing_id: bytes
    status: dict[str, Any] = field(default_factory=dict)
    status_at: float = 0.0
    reported: bool = False  # this incarnation sent a status
    metrics_text: str = ""
    answered: int = 0  # the last scrape id it answered


class Front:
    """The process in front of ``count`` shards."""

    def __init__(
        self,
        config: GatewayConfig,
        count: int,
        *,
        config_path: Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        notifier: SystemdNotifier | None = None,
    ) -> None:
        self.config = config
        self.count = count
        self.config_path = config_path
        self._overrides = dict(overrides or {})
        self.notifier = notifier or SystemdNotifier()
        self.metrics = GatewayMetrics(models=config.routing.models)
        r = self.metrics.registry
        self._dropped = Counter(
            f"{NS}_shard_frames_dropped",
            "Agent frames and replies the front could not pass on, by reason (the agent resends)",
            ["reason"],
            registry=r,
        )
        self._restarts = Counter(
            f"{NS}_shard_restarts", "Shard processes that ended and were restarted", registry=r
        )
        self._serving = Gauge(f"{NS}_shards_serving", "Shards alive and ready", registry=r)
        self._configured = Gauge(f"{NS}_shards", "Shards configured", registry=r)
        self._configured.set(count)
        for reason in ("shard_down", "shard_busy", "reply_unreachable", "reply_full", "reply_closed"):
            self._dropped.labels(reason)
        self._logging = LogSettings(config.logging)
        self.draining = False
        self.carriers: dict[str, CarrierIngress] = {}
        self._carrier_list: list[CarrierIngress] = []
        self._tags: dict[str, bytes] = {}
        self._shards: list[_Shard] = []
        self._by_routing_id: dict[bytes, _Shard] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: AgentAuthenticator | None = None
        self._link_owner: zmq.asyncio.Socket | None = None
        self._link: zmq.Socket[bytes] | None = None
        self._link_reader: EdgeReader | None = None  # until the carriers are bound; then the relay's
        self._relay: Relay | None = None
        # Connections the shards' budgets hold: their request batches refused here, their reading paced.
        self.holds = FrontHolds(
            [c.name for c in config.carriers],
            config.budget.held_reads_per_s,
            self.metrics,
            config.limits.max_header_bytes,
        )
        self._run_dir: str | None = None
        self.http: HealthServer | None = None
        health = config.health
        self._carrier_health = CarrierHealth(
            [c.name for c in config.carriers], health.rise, health.fall, health.stall_s
        )
        self._snapshot = self._carrier_health.initial()
        self._retired = Retired()
        self._scrape_id = 0
        self._scraped: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed_start: str | None = None
        self._started = False
        self._closed = False
        interval = config.health.interval_s
        self.stale_after_s = max(2.0, 4 * interval)
        self.wedged_after_s = max(10.0, 20 * interval)
        self.exec_to_start_s: float | None = None

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        cfg = self.config
        started = time.monotonic()
        try:
            admin_token = self._admin_token()
            self._ctx = zmq.asyncio.Context()
            try:
                security = self._start_security()
            except (KeyFileError, OSError) as exc:
                raise FrontStartError(f"security: {exc}") from exc
            link = self._start_link()
            for index in range(self.count):
                command = shard_command(index, self.count, link, self.config_path, self._overrides)
                shard = _Shard(ShardProcess(index, command, self._shard_exited), shard_routing_id(index))
                self._shards.append(shard)
                self._by_routing_id[shard.routing_id] = shard
                shard.process.start()
            await self._wait_for_shards(started + START_TIMEOUT_S)
            shards_ms = round((time.monotonic() - started) * 1000, 1)
            for index, carrier_cfg in enumerate(cfg.carriers):
                carrier = CarrierIngress(
                    carrier_cfg, self._ctx, cfg.zmq, cfg.limits, self.metrics, self._no_reader, security
                )
                try:
                    carrier.start()
                except zmq.ZMQError as exc:
                    raise FrontStartError(
                        f"carrier {carrier_cfg.name}: cannot bind {carrier_cfg.bind}: {exc}"
                    ) from exc
                self.carriers[carrier_cfg.name] = carrier
                self._carrier_list.append(carrier)
                self._tags[carrier_cfg.name] = tag(FRAME, index)
            self._start_relay()
            self._evaluate_health()
            http = self._start_http(admin_token)
            self._background(self._health_loop(), "health")
            if self.notifier.watchdog_s:
                self._background(watchdog(self.notifier), "watchdog")
        except BaseException:
            await self.aclose()
            raise
        self.notifier.notify("READY=1")
        log.info(
            "gateway ready",
            instance=cfg.instance,
            carriers={n: c.endpoint for n, c in self.carriers.items()},
            http_port=http.port,
            pools=sorted(cfg.pools),
            shards=self.count,
            shard_pids=[s.process.pid for s in self._shards],
            startup_ms={"shards": shards_ms, "total": round((time.monotonic() - started) * 1000, 1)},
        )

    def _start_link(self) -> str:
        assert self._ctx is not None
        self._run_dir = tempfile.mkdtemp(prefix="hk-gateway-", dir=os.environ.get("RUNTIME_DIRECTORY"))
        endpoint = f"ipc://{self._run_dir}/link"
        owner = self._ctx.socket(zmq.ROUTER)
        owner.setsockopt(zmq.ROUTER_MANDATORY, 1)
        owner.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted shard takes its routing id over at once
        link_socket_options(owner, self.config.zmq)
        owner.bind(endpoint)
        self._link_owner = owner
        self._link = zmq.Socket.shadow(owner.underlying)
        self._link_reader = EdgeReader(
            self._link, self._from_shard, self._link_failed, self.config.zmq.max_messages_per_wakeup
        )
        self._link_reader.start()
        return endpoint

    def _start_relay(self) -> None:
        """From here on one thread moves all traffic (gateway/shards/relay.py); the loop keeps the rest."""
        assert self._ctx is not None
        assert self._link is not None
        assert self._loop is not None
        if self._link_reader is not None:
            self._link_reader.stop()  # the relay reads the link from now on (zmq_poll misses no edge)
        self._relay = Relay(
            self._ctx,
            self._link,
            self._carrier_list,
            self._forward,
            self._from_shard,
            lambda reason: self._dropped.labels(reason).inc(),
            self.metrics,
            self._loop,
            self.config.zmq.max_messages_per_wakeup,
            self.holds,
        )
        self._relay.start()

    async def _wait_for_shards(self, deadline: float) -> None:
        while not all(s.reported for s in self._shards):
            if self._failed_start is not None:
                raise FrontStartError(self._failed_start)
            if time.monotonic() > deadline:
                late = [s.process.index for s in self._shards if not s.reported]
                raise FrontStartError(f"shards {late} did not start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)

    def _start_security(self) -> dict[int, object] | None:
        sec = self.config.security
        if sec.mode != "curve":
            return None
        assert sec.server_secret_key is not None
        assert sec.authorized_agents is not None
        assert self._ctx is not None
        public, secret = load_server_keys(sec.server_secret_key)
        self._auth = AgentAuthenticator(
            self._ctx,
            load_directory(sec.authorized_agents),
            self.metrics,
            [c.name for c in self.config.carriers],
        )
        self._auth.start()
        return curve_options(public, secret)

    def _admin_token(self) -> str | None:
        try:
            return admin_token_of(self.config.http.admin_token_file)
        except ValueError as exc:
            raise FrontStartError(str(exc)) from exc

    def _start_http(self, admin_token: str | None) -> HealthServer:
        cfg = self.config
        self.http = http = HealthServer(
            cfg.http.host,
            cfg.http.port,
            lambda: self._snapshot,
            self.metrics,
            self._set_carrier_enabled_threadsafe,
            stale_after_s=max(2.0, 4 * cfg.health.interval_s),
            set_capture=self._set_capture_threadsafe,
            admin_token=admin_token,
            render_metrics=self._render_metrics,
        )
        try:
            http.start()
        except OSError as exc:
            raise FrontStartError(f"http: cannot listen on {cfg.http.host}:{cfg.http.port}: {exc}") from exc
        return http

    # ------------------------------------------------------------------ frames both ways

    def _no_reader(self, carrier: object, frames: list[zmq.Frame]) -> None:
        raise AssertionError("the front's carriers are read by its relay thread")

    def _forward(self, carrier: CarrierIngress, frames: list[zmq.Frame]) -> list[bytes | zmq.Frame]:
        """An agent's message -> the link message that takes it to its shard, parts as received
        ([routing id, envelope, payload]). On the relay thread."""
        header = frames[1] if len(frames) > 1 else frames[0]
        if self._auth is not None:
            user, peer = carrier.peer_property(header, "User-Id"), ""
            agent = user
        else:
            user, peer = "", carrier.peer_property(header, "Peer-Address")
            agent = self._envelope_agent(header)
        # A frame that names no agent goes to a shard by its connection, to be refused there with a reason.
        index = shard_of(agent, self.count) if agent else zlib.crc32(frames[0].bytes) % self.count
        return [
            self._shards[index].routing_id,
            self._tags[carrier.name],
            frames[0],
            user.encode(),
            peer.encode(),
            *frames[1:],
        ]

    def _envelope_agent(self, header: zmq.Frame) -> str:
        if len(header) > self.config.limits.max_header_bytes:
            return ""
        try:
            return pb.Envelope.FromString(header.buffer).agent_id  # type: ignore[arg-type]
        except DecodeError:
            return ""

    def _from_shard(self, frames: list[zmq.Frame]) -> None:
        """What a shard tells the front itself (on the loop); its replies to agents the relay sends."""
        shard = self._by_routing_id.get(frames[0].bytes)
        if shard is None or len(frames) < 2:
            log.error("message on the link from no known shard", parts=len(frames))
            return
        head = frames[1].bytes
        kind = head[:1]
        try:
            if kind == STATUS and len(frames) == 3:
                status = json.loads(frames[2].bytes)
                if not isinstance(status, dict):
                    raise ValueError(f"a status is a JSON object, not {type(status).__name__}")
                shard.status = status
                shard.status_at = time.monotonic()
                shard.reported = True
            elif kind == METRICS and len(frames) == 4:
                text, answered = frames[3].bytes.decode(), int(frames[2].bytes)
                shard.metrics_text, shard.answered = text, answered
                if self._scraped is not None and all(
                    s.answered >= self._scrape_id for s in self._shards if s.process.alive and s.reported
                ):
                    self._scraped.set()
            else:
                log.error("unexpected message on the link", shard=shard.process.index, head=head[:8].hex())
        except ValueError as exc:  # JSON, int() and UTF-8 errors: one bad message, not the link's end
            # Raised, it would leave the rest of the link's queue unread until the next edge (the loop's
            # reader) or cut short the read before the shards exit (_read_link_dry, at drain).
            log.error(
                "malformed message on the link", shard=shard.process.index, kind=kind.hex(), error=str(exc)
            )

    def _link_failed(self, exc: zmq.ZMQError) -> None:
        log.error("shard link receive failed", error=repr(exc))

    def _send_to(self, shard: _Shard, parts: list[bytes]) -> bool:
        if self._relay is not None:
            return self._relay.to_shard([shard.routing_id, *parts])
        if self._link is None:
            return False
        try:
            self._link.send_multipart([shard.routing_id, *parts], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        finally:
            if self._link_reader is not None:
                self._link_reader.schedule()
        return True

    # ------------------------------------------------------------------ shards' lives

    def _shard_exited(self, process: ShardProcess, code: int) -> None:
        shard = self._shards[process.index]
        if not shard.reported and code in FAILED_START_CODES and not self._started_all():
            self._failed_start = f"shard {process.index} could not start (exit {code}); see its log lines"
        if shard.metrics_text:
            self._retired.add(shard.metrics_text)  # its counters stay in the sums
        shard.metrics_text, shard.status, shard.reported, shard.answered = "", {}, False, 0
        if not self.draining and not self._closed:
            self._restarts.inc()
        self._evaluate_health()

    def _started_all(self) -> bool:
        return bool(self.carriers)  # carriers are bound once every shard reported

    def _check_shards(self, now: float) -> None:
        for shard in self._shards:
            process = shard.process
            if not process.alive:
                continue
            since = shard.status_at if shard.reported else process.started_at
            limit = self.wedged_after_s if shard.reported else START_TIMEOUT_S
            if now - since > limit:
                log.error(
                    "shard stopped reporting; killing it", shard=process.index, silent_s=round(now - since, 1)
                )
                process.kill()

    # ------------------------------------------------------------------ health

    def _evaluate_health(self) -> None:
        now = time.monotonic()
        live = [
            s
            for s in self._shards
            if s.process.alive and s.reported and now - s.status_at <= self.stale_after_s
        ]
        serving = [s for s in live if s.status.get("ready")]
        tiers: dict[str, bool] = {}
        for shard in live:
            for tier, ok in shard.status.get("tiers", {}).items():
                tiers[tier] = tiers.get(tier, False) or bool(ok)
        missing = self.count - len(serving)
        degraded = missing > 0 or not all(tiers.values())
        why = f"{missing} of {self.count} shards not serving" if missing else "a tier has no healthy pool"
        states, details = self._carrier_health.evaluate(
            self.carriers,
            now,
            draining=self.draining,
            degraded=degraded,
            why_degraded=why,
            serving=bool(serving),
        )
        for name, state in states.items():
            self.metrics.carrier_up.labels(name).set(state.gauge)
        ready = (
            bool(serving)
            and bool(tiers)
            and all(tiers.values())
            and any(c.bound for c in self.carriers.values())
        )
        self._serving.set(len(serving))
        self.metrics.ready.set(1 if ready and not self.draining else 0)
        self._snapshot = HealthSnapshot(
            now, states, details, ready=ready and not self.draining, draining=self.draining, tiers=tiers
        )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health.interval_s)
            self._check_shards(time.monotonic())
            self._evaluate_health()

    @property
    def snapshot(self) -> HealthSnapshot:
        return self._snapshot

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

    # ------------------------------------------------------------------ metrics and admin

    async def scrape(self) -> tuple[str, list[str], Retired]:
        """Every live shard's series, fresh (within SCRAPE_WAIT_S), the front's own, and the retired."""
        self._scrape_id += 1
        self._scraped = event = asyncio.Event()
        asked = [s for s in self._shards if s.process.alive and s.reported]
        for shard in asked:
            self._send_to(shard, [QUERY, str(self._scrape_id).encode()])
        if asked:
            try:
                await asyncio.wait_for(event.wait(), SCRAPE_WAIT_S)
            except TimeoutError:
                late = [s.process.index for s in asked if s.answered < self._scrape_id]
                log.warning("shards did not send their metrics in time", shards=late)
        texts = [s.metrics_text for s in self._shards if s.metrics_text]
        return self.metrics.render().decode(), texts, self._retired.copy()

    async def _render_metrics(self) -> bytes:
        """On the HTTP thread: the shards' series collected on the front's loop, merged here."""
        assert self._loop is not None
        own, texts, retired = await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self.scrape(), self._loop)
        )
        return merge(own, texts, retired)

    def _broadcast(self, command: Mapping[str, Any]) -> None:
        body = json.dumps(dict(command)).encode()
        for shard in self._shards:
            if shard.process.alive:
                self._send_to(shard, [COMMAND, body])

    def _set_capture_threadsafe(self, seconds: float) -> float:
        """Admin capture (HTTP thread): every shard captures its own agents' traffic (its own directory)."""
        if self._loop is None:
            return 0.0
        seconds = min(seconds, self.config.capture.max_enable_s)
        if seconds > 0:
            self.holds.clear()  # a capture sees every frame whole (the shards release theirs too)
        self._loop.call_soon_threadsafe(self._broadcast, {"capture_s": seconds})
        return 0.0 if seconds <= 0 else time.time() + seconds

    # ------------------------------------------------------------------ serve, reload, drain, close

    async def serve(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
            await self.drain()
        finally:
            await self.aclose()

    def reload(self) -> bool:
        """SIGHUP: check the file, reload the front's part (agent keys, logging), then every shard's."""
        try:
            fresh = load_config(self.config_path, overrides=self._overrides)
            agents = None
            if self._auth is not None and fresh.security.authorized_agents is not None:
                agents = load_directory(fresh.security.authorized_agents)
        except Exception as exc:  # noqa: BLE001  (any reload failure keeps the running config)
            self.metrics.reloads.labels("failed").inc()
            log.error("reload failed; keeping the running config", error=str(exc))
            return False
        if fresh.shards != self.config.shards:
            log.warning("shards changes at the next restart", running=self.count, configured=fresh.shards)
        if self._auth is not None and agents is not None:
            self._auth.replace(agents)
        self.holds.clear()  # a revoked or remapped key's frames meet the identity checks again, in a shard
        logging_changed = self._logging.apply(fresh.logging)
        for shard in self._shards:
            shard.process.signal(signal.SIGHUP)
        self.metrics.reloads.labels("ok").inc()
        log.info("reloaded", shards=self.count, logging_changed=logging_changed)
        return True

    async def drain(self) -> None:
        """Health DRAINING at once; every shard drains (nacks new work, finishes and answers what it
        accepted) and exits; their last replies pass through here before the carriers close."""
        if self.draining:
            return
        self.draining = True
        self.notifier.notify("STOPPING=1")
        self.metrics.draining.set(1)
        self._evaluate_health()
        cfg = self.config
        log.info("draining", shards=self.count, deadline_s=cfg.drain_timeout_s, grace_s=cfg.drain_grace_s)
        limit = cfg.drain_grace_s + cfg.drain_timeout_s + 10.0
        await asyncio.gather(*(s.process.stop(limit) for s in self._shards))
        if self._relay is None:
            self._read_link_dry()  # else the relay passes the last replies on as it stops
        log.info("drained", shards=self.count, exits=[s.process.exits[-1:] for s in self._shards])

    def _read_link_dry(self) -> None:
        """What the shards sent before exiting and the reader has not taken yet."""
        link = self._link
        if link is None:
            return
        for _ in range(1_000_000):
            try:
                frames = link.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                return
            self._from_shard(frames)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.process.stop(5.0) for s in self._shards))
        if self.http is not None:
            self.http.stop()
        if self._relay is not None:
            self._relay.stop()  # first: it sends on the carriers and the link until it ends
            self._relay = None
        for carrier in self.carriers.values():
            await carrier.close()
        if self._link_reader is not None:
            self._link_reader.stop()
        self._link = None
        if self._link_owner is not None:
            self._link_owner.close(0)
            self._link_owner = None
        if self._auth is not None:
            self._auth.stop()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def _background(self, body: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(body, name=name))
