"""The carrier ingresses as this agent sees them: one DEALER each, liveness and RTT from Pongs, and what
libzmq's socket monitor says about the connection underneath."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edge_agent.config import UplinkConfig

MONITORED: Final[dict[int, str]] = {
    zmq.EVENT_CONNECTED: "connected",
    zmq.EVENT_CONNECT_DELAYED: "connect_delayed",
    zmq.EVENT_CONNECT_RETRIED: "connect_retried",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshake_succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_failed",
}
"""Socket monitor events counted per carrier (``Carrier.events``), by the name they are counted under."""


@dataclass(slots=True)
class Carrier:
    """One carrier ingress: its socket, what its Pongs said, and what its socket monitor reported."""

    name: str
    endpoint: str
    sock: zmq.asyncio.Socket
    rtt_s: float = 0.0
    last_pong: float = 0.0
    epoch: int = 0
    draining: bool = False
    up: bool = False  # live when last looked at: a change to dead resends what it held, once
    task: asyncio.Task[None] | None = None
    monitor: zmq.asyncio.Socket | None = None
    monitor_task: asyncio.Task[None] | None = None
    came_up: int = 0  # changes from dead to live
    went_down: int = 0  # changes from live to dead
    events: Counter[str] = field(default_factory=Counter)  # socket monitor events, by MONITORED name
    retry_waits_ms: list[int] = field(default_factory=list)  # the last reconnect waits libzmq chose

    def alive(self, now: float, dead_after_s: float) -> bool:
        return self.last_pong > 0 and now - self.last_pong < dead_after_s and not self.draining

    def dies_at(self, dead_after_s: float) -> float:
        """When it counts as dead without another Pong."""
        return self.last_pong + dead_after_s

    def pong(self, now: float, rtt_s: float, draining: bool) -> None:
        """A Pong arrived: RTT as an EWMA (the first sample, then 0.2 new + 0.8 old)."""
        self.rtt_s = rtt_s if not self.rtt_s else 0.2 * rtt_s + 0.8 * self.rtt_s
        self.last_pong = now
        self.draining = draining

    def close(self) -> None:
        """Close the socket and its monitor (the tasks reading them are the caller's to cancel)."""
        if self.monitor is not None:
            # First: libzmq's I/O thread sends each event to the monitor blocking, holding the socket's
            # monitor mutex; an event after the monitor's other end closed would block it for good.
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None
        self.sock.close(0)


def open_carrier(
    context: zmq.asyncio.Context,
    name: str,
    endpoint: str,
    up: UplinkConfig,
    curve: tuple[bytes, bytes, bytes] | None,
) -> Carrier:
    """A DEALER connected to ``endpoint`` with the uplink's socket options (docs/AGENT.md section 4), its
    monitor socket attached before the connect so that the first connection's events are seen."""
    sock = context.socket(zmq.DEALER)
    monitor: zmq.asyncio.Socket | None = None
    try:
        _configure(sock, up, curve)
        monitor = sock.get_monitor_socket(sum(set(MONITORED)))
        sock.connect(endpoint)
    except BaseException:
        if monitor is not None:
            monitor.close(0)
        sock.close(0)  # else the context's term() waits for it forever
        raise
    return Carrier(name, endpoint, sock, monitor=monitor)


def jittered_ms(value_ms: int, jitter: float) -> int:
    """``value_ms`` spread at random over [1 - jitter, 1 + jitter] of itself, at least 1."""
    return max(1, round(value_ms * random.uniform(1.0 - jitter, 1.0 + jitter)))


def _configure(sock: zmq.asyncio.Socket, up: UplinkConfig, curve: tuple[bytes, bytes, bytes] | None) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, up.sndhwm)
    sock.setsockopt(zmq.RCVHWM, up.sndhwm)
    # libzmq doubles the interval up to the cap but does not randomise it when a cap is set: spread each
    # socket's interval and cap so that a region's agents do not reconnect in lockstep after an outage.
    ivl = jittered_ms(up.reconnect_ivl_ms, up.reconnect_jitter)
    sock.setsockopt(zmq.RECONNECT_IVL, ivl)
    sock.setsockopt(
        zmq.RECONNECT_IVL_MAX, max(ivl, jittered_ms(up.reconnect_ivl_max_ms, up.reconnect_jitter))
    )
    # Without a connect timeout a connect() into a black hole waits out the kernel's SYN retries (1, 3, 7,
    # 15 ... s: tens of seconds), and a carrier that is reachable again stays unused until they end.
    sock.setsockopt(zmq.CONNECT_TIMEOUT, up.connect_timeout_ms)
    sock.setsockopt(zmq.TCP_MAXRT, up.tcp_maxrt_ms)
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(up.dead_after_s * 1000))
    sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a carrier that is not connected
    if curve is not None:
        public, secret, server = curve
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server


async def watch_connection(carrier: Carrier, on_connected: Callable[[Carrier], None]) -> None:
    """Count the carrier's socket monitor events; call ``on_connected`` when a ZMTP handshake completes
    (the carrier can be pinged now, not at the next ping interval)."""
    monitor = carrier.monitor
    if monitor is None:
        return
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())
        name = MONITORED.get(event["event"])
        if name is None:
            continue
        carrier.events[name] += 1
        if name == "connect_retried":
            carrier.retry_waits_ms.append(int(event["value"]))
            del carrier.retry_waits_ms[:-16]
        elif name == "handshake_succeeded":
            on_connected(carrier)


def best_carrier(carriers: Iterable[Carrier], now: float, dead_after_s: float) -> Carrier | None:
    """The live carrier with the lowest RTT (ties: name), or None."""
    live = [c for c in carriers if c.alive(now, dead_after_s)]
    return min(live, key=lambda c: (c.rtt_s, c.name), default=None)
