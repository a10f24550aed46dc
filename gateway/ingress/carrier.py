"""One carrier uplink: a ROUTER socket bound on that carrier's ingress address, with its liveness.

Socket options are set deliberately: ROUTER_MANDATORY (a reply to a vanished agent raises and is counted
instead of vanishing), bounded HWMs, MAXMSGSIZE from the codec limits (libzmq drops larger messages before
Python sees them), ZMTP heartbeats (dead agents are noticed), and CURVE with a ZAP domain per carrier.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edgewire.parts import send_parts
from gateway.config import CarrierConfig, LimitsConfig, ZmqConfig
from gateway.ingress.reader import EdgeReader
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.ingress")

OnMessage = Callable[["Carrier", list[zmq.Frame]], None]
_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
}
_CONNECTION_EVENTS: dict[int, str] = {
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_ACCEPT_FAILED: "accept_failed",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
    **dict.fromkeys(_HANDSHAKE_FAILURES, "handshake_failed"),
    zmq.EVENT_DISCONNECTED: "disconnected",
}
CONNECTION_EVENTS: Final = tuple(dict.fromkeys(_CONNECTION_EVENTS.values()))
"""The ``event`` labels of ``hkgw_carrier_connections_total``. A connection goes accepted -> handshake
succeeded or failed -> disconnected; accept_failed is one the ROUTER could not take (e.g. out of file
descriptors). They are what the gateway can know of frames that never arrived: frames an agent drops from
its own queue when it closes its socket never reach this side (docs/PROTOCOL.md section 2)."""
_MONITORED = functools.reduce(operator.or_, _CONNECTION_EVENTS)
_DEFAULT_HEARTBEAT_TIMEOUT_MS = int(ZmqConfig.model_fields["heartbeat_timeout_ms"].default)


def silent_after_s(z: ZmqConfig) -> float:
    """How long a peer may go unheard on a carrier before it counts as gone: libzmq closes a connection
    that sends nothing for the ZMTP heartbeat timeout after a heartbeat (the interval, when no timeout is
    set). With heartbeats off nothing closes it; the configured default is used."""
    if z.heartbeat_ivl_ms:
        return (z.heartbeat_timeout_ms or z.heartbeat_ivl_ms) / 1000
    return _DEFAULT_HEARTBEAT_TIMEOUT_MS / 1000


class Carrier(Protocol):
    """What the rest of the gateway uses of a carrier: a ROUTER bound here (:class:`CarrierIngress`), or in
    a shard, a carrier's view of the link to the front that owns the ROUTER (gateway/shards/link.py)."""

    name: str

    @property
    def endpoint(self) -> str: ...

    @property
    def silent_after_s(self) -> float: ...

    @property
    def bound(self) -> bool: ...

    @property
    def receiving(self) -> bool: ...

    def more_waiting(self) -> bool:
        """Whether another message waits to be read now (EdgeReader.waiting_now): a lone realtime request
        is served at once only when none does (gateway/ingest.py)."""
        ...

    def pause_reading(self, seconds: float) -> bool:
        """Read nothing for ``seconds``: a held connection's frames paced (gateway/ingress/budget.py
        HeldReadPace). Where this process does not read the ROUTER itself, nothing (False)."""
        ...

    def hold(self, routing_id: bytes, agent_id: str, seconds: float) -> None:
        """The ingest holds this connection for ``seconds`` for frames naming ``agent_id``
        (HeldConnections). Where this process reads the ROUTER, nothing more (the ingest refuses them and
        paces this carrier's reading itself); in a shard, the front is told, which then does both
        (gateway/shards/holds.py)."""
        ...

    def stalled(self, now: float, stall_s: float) -> bool: ...

    def peer_property(self, header: zmq.Frame, name: str) -> str: ...

    def send(self, routing_id: bytes, frames: Sequence[bytes | zmq.Frame]) -> str: ...

    async def close(self) -> None: ...


class SendResult:
    SENT = "sent"
    UNREACHABLE = "unreachable"  # no such peer on this carrier (ROUTER_MANDATORY)
    FULL = "full"  # peer's queue at HWM
    CLOSED = "closed"


def send_to_peer(sock: zmq.Socket[bytes], routing_id: bytes, frames: Sequence[bytes | zmq.Frame]) -> str:
    """One message to a peer of a ROUTER with ROUTER_MANDATORY, without blocking; what happened."""
    try:
        send_parts(sock, [routing_id, *frames])
    except zmq.Again:
        return SendResult.FULL
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            return SendResult.UNREACHABLE
        raise
    return SendResult.SENT


class CarrierIngress:
    """Receives agent traffic on one carrier and sends replies to agents connected through it."""

    def __init__(
        self,
        config: CarrierConfig,
        context: zmq.asyncio.Context,
        zmq_config: ZmqConfig,
        limits: LimitsConfig,
        metrics: GatewayMetrics,
        on_message: OnMessage,
        security: dict[int, Any] | None = None,
    ) -> None:
        self.name = config.name
        self.bind = config.bind
        self._ctx = context
        self._zcfg = zmq_config
        self._limits = limits
        self._metrics = metrics
        self._on_message = on_message
        self._security = security or {}
        self._sock: zmq.Socket[bytes] | None = None
        self._owner: zmq.asyncio.Socket | None = None
        self._reader: EdgeReader | None = None
        self._handed: Callable[[float, float], bool] | None = None  # the traffic thread's stall test
        self._endpoint = config.bind
        self._tasks: list[asyncio.Task[None]] = []
        self.peers = 0
        self.last_recv = 0.0
        self.messages = 0
        self.failed: str | None = None  # set when the receive loop died

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Create and bind the ROUTER; raises zmq.ZMQError when the address cannot be bound."""
        sock = self._ctx.socket(zmq.ROUTER)
        z = self._zcfg
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVHWM, z.rcvhwm)
        sock.setsockopt(zmq.SNDHWM, z.sndhwm)
        sock.setsockopt(zmq.LINGER, z.linger_ms)
        # libzmq drops a message part over MAXMSGSIZE and disconnects its peer, before Python sees it and
        # without a reason we could count. Set it at twice the codec's limit: frames moderately over the
        # limit reach the codec and are refused as frame_too_large (counted); giant ones never allocate.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._limits.max_frame_bytes + self._limits.max_header_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, z.heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, z.heartbeat_timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, z.heartbeat_ttl_ms)
        sock.setsockopt(zmq.ZAP_DOMAIN, self.name.encode())
        for option, value in self._security.items():
            sock.setsockopt(option, value)
        monitor = sock.get_monitor_socket(_MONITORED)
        try:
            sock.bind(self.bind)
        except zmq.ZMQError:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise
        self._owner = sock
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        self._endpoint = last.decode() if isinstance(last, bytes) else str(last)
        # Traffic goes through a plain view of the same socket (see "traffic" below); the zmq.asyncio
        # socket owns it, and its monitor, and closes them.
        self._sock = zmq.Socket.shadow(sock.underlying)
        self._reader = EdgeReader(
            self._sock, self._deliver, self._read_failed, self._zcfg.max_messages_per_wakeup
        )
        self._reader.start()
        self._tasks = [asyncio.create_task(self._monitor(monitor), name=f"monitor-{self.name}")]
        self._metrics.carrier_peers.labels(self.name).set(0)
        for event in CONNECTION_EVENTS:  # every series exported from the start, zeros included
            self._metrics.carrier_connections.labels(self.name, event)
        for reason in _HANDSHAKE_FAILURES.values():
            self._metrics.handshake_failures.labels(self.name, reason)
        log.info("carrier bound", carrier=self.name, endpoint=self.endpoint, curve=bool(self._security))

    async def close(self) -> None:
        # The monitor goes first: libzmq's I/O thread sends each event to the monitor socket blocking,
        # holding the socket's monitor mutex, so an event (an agent disconnecting) after our end of the
        # monitor closed would block that thread for good and disable_monitor() with it (libzmq #3575).
        if self._owner is not None:
            self._owner.disable_monitor()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._stop_reading()
        self._sock = None
        if self._owner is not None:
            self._owner.close(self._zcfg.linger_ms)
            self._owner = None

    def hand_over(self, stalled: Callable[[float, float], bool]) -> zmq.Socket[bytes]:
        """Give the socket's traffic to another thread (the shards' front: gateway/shards/relay.py): the
        loop stops reading it and from now on only that thread receives and sends on it, keeping
        ``last_recv`` and ``messages`` and setting ``failed``. ``stalled(now, stall_s)`` is that thread's
        own answer to :meth:`stalled` (it reads whenever input waits, so it stalls only when it is stuck).
        The monitor, ZAP and close stay here."""
        if self._sock is None:
            raise RuntimeError(f"carrier {self.name} is not bound")
        self._stop_reading()
        self._handed = stalled
        return self._sock

    @property
    def endpoint(self) -> str:
        """The address actually bound (``tcp://127.0.0.1:*`` binds a free port)."""
        return self._endpoint

    @property
    def silent_after_s(self) -> float:
        return silent_after_s(self._zcfg)

    @property
    def bound(self) -> bool:
        return self._sock is not None

    @property
    def receiving(self) -> bool:
        if self._handed is not None:
            return self._sock is not None and self.failed is None
        return self._reader is not None and self._reader.reading and self.failed is None

    def more_waiting(self) -> bool:
        return self._reader is not None and self._reader.waiting_now()

    def pause_reading(self, seconds: float) -> bool:
        if self._reader is None:
            return False
        self._reader.pause(seconds)
        return True

    def hold(self, routing_id: bytes, agent_id: str, seconds: float) -> None:
        return None  # the ingest that reads this ROUTER holds the connection itself

    def stalled(self, now: float, stall_s: float) -> bool:
        """True when input is waiting but nothing was read for ``stall_s``: the carrier passes no traffic."""
        if self._sock is None:
            return True
        if self._handed is not None:
            return self._handed(now, stall_s)
        pending = bool(int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)
        if pending:
            # Reading ZMQ_EVENTS consumes the FD's edge: whatever is waiting is read on the next tick.
            self._schedule_read()
        return pending and now - self.last_recv > stall_s

    # ------------------------------------------------------------------ traffic

    def _schedule_read(self) -> None:
        if self._reader is not None:
            self._reader.schedule()

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.stop()

    def _read_failed(self, exc: zmq.ZMQError) -> None:
        self.failed = repr(exc)
        log.error("carrier receive failed; not reading any more", carrier=self.name, error=repr(exc))

    def peer_property(self, header: zmq.Frame, name: str) -> str:
        """A ZeroMQ message property of a frame read here (``User-Id`` from ZAP, ``Peer-Address``)."""
        return str(header.get(name) or "")

    def _deliver(self, frames: list[zmq.Frame]) -> None:
        self.last_recv = time.monotonic()
        self.messages += 1
        try:
            self._on_message(self, frames)
        except Exception:  # a bug in handling one frame must not take the whole carrier down
            self._metrics.ingest_errors.labels(self.name).inc()
            log.exception("handling a frame failed", carrier=self.name)

    def send(self, routing_id: bytes, frames: Sequence[bytes | zmq.Frame]) -> str:
        """Send one message to a peer without blocking; the result says what happened."""
        sock = self._sock
        if sock is None:
            return SendResult.CLOSED
        try:
            return send_to_peer(sock, routing_id, frames)
        finally:
            if self._reader is not None:
                self._reader.after_send()

    async def _monitor(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                kind = event["event"]
                counted = _CONNECTION_EVENTS.get(kind)
                if counted is not None:
                    self._metrics.carrier_connections.labels(self.name, counted).inc()
                if kind == zmq.EVENT_ACCEPTED:
                    self.peers += 1
                elif kind == zmq.EVENT_DISCONNECTED:
                    self.peers = max(0, self.peers - 1)
                elif kind in _HANDSHAKE_FAILURES:
                    reason = _HANDSHAKE_FAILURES[kind]
                    self._metrics.handshake_failures.labels(self.name, reason).inc()
                    log.info(
                        "handshake refused",
                        carrier=self.name,
                        reason=reason,
                        peer=event.get("endpoint", b"").decode(errors="replace"),
                    )
                self._metrics.carrier_peers.labels(self.name).set(self.peers)
        finally:
            monitor.close(0)
