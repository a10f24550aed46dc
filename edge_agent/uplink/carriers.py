"""The carrier ingresses as this agent sees them: one DEALER each, liveness and RTT from Pongs."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from edge_agent.config import UplinkConfig


@dataclass(slots=True)
class Carrier:
    """One carrier ingress: its socket, and what its Pongs said."""

    name: str
    endpoint: str
    sock: zmq.asyncio.Socket
    rtt_s: float = 0.0
    last_pong: float = 0.0
    epoch: int = 0
    draining: bool = False
    up: bool = False  # live when last looked at: a change to dead resends what it held, once
    task: asyncio.Task[None] | None = None

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


def open_carrier(
    context: zmq.asyncio.Context,
    name: str,
    endpoint: str,
    up: UplinkConfig,
    curve: tuple[bytes, bytes, bytes] | None,
) -> Carrier:
    """A DEALER connected to ``endpoint`` with the uplink's socket options (docs/AGENT.md section 4)."""
    sock = context.socket(zmq.DEALER)
    try:
        _configure(sock, endpoint, up, curve)
    except BaseException:
        sock.close(0)  # else the context's term() waits for it forever
        raise
    return Carrier(name, endpoint, sock)


def _configure(
    sock: zmq.asyncio.Socket, endpoint: str, up: UplinkConfig, curve: tuple[bytes, bytes, bytes] | None
) -> None:
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
    if curve is not None:
        public, secret, server = curve
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server
    sock.connect(endpoint)


def best_carrier(carriers: Iterable[Carrier], now: float, dead_after_s: float) -> Carrier | None:
    """The live carrier with the lowest RTT (ties: name), or None."""
    live = [c for c in carriers if c.alive(now, dead_after_s)]
    return min(live, key=lambda c: (c.rtt_s, c.name), default=None)
