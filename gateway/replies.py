"""Answers to agents: on whichever carrier the agent is reachable through, coalesced per loop tick.

The gateway remembers, per agent, the routing id it last used on each carrier. A response goes out on the
carrier the agent spoke on most recently; if that peer is gone (ROUTER_MANDATORY says so) the next one is
tried. An agent reachable on none has its responses kept, bounded, until it shows up again (any frame,
e.g. its next ping), then they are delivered.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from edgewire import FrameCodec, Serialized, pb, repeated_field
from gateway.config import RepliesConfig
from gateway.ingress.carrier import CarrierIngress, SendResult
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.replies")
MAX_RESPONSES_PER_FRAME = 256
RESPONSES_FIELD = pb.ResponseBatch.DESCRIPTOR.fields_by_name["responses"].number


@dataclass(slots=True)
class _AgentRoutes:
    by_carrier: dict[str, tuple[bytes, float]] = field(default_factory=dict)  # carrier -> (routing id, seen)
    pending: deque[bytes] = field(default_factory=deque)  # serialized responses


class ReplyRouter:
    """Finds a way back to each agent and sends it its responses."""

    def __init__(
        self,
        carriers: Mapping[str, CarrierIngress],
        codec: FrameCodec,
        config: RepliesConfig,
        metrics: GatewayMetrics,
        instance: str,
    ) -> None:
        self._carriers = carriers
        self._codec = codec
        self._config = config
        self._metrics = metrics
        self._instance = instance
        self._agents: OrderedDict[str, _AgentRoutes] = OrderedDict()
        self._outbox: dict[str, list[bytes]] = {}
        self._flush_scheduled = False
        self.pending_total = 0

    # ------------------------------------------------------------------ who is where

    def seen(self, agent_id: str, carrier: str, routing_id: bytes, now: float) -> None:
        """An agent spoke on a carrier: remember the route, deliver anything it missed."""
        routes = self._routes_of(agent_id)
        routes.by_carrier[carrier] = (routing_id, now)
        if routes.pending:
            self._outbox.setdefault(agent_id, []).extend(routes.pending)
            self.pending_total -= len(routes.pending)
            routes.pending.clear()
            self._metrics.pending_replies.set(self.pending_total)
            self._schedule()

    def _routes(self, agent_id: str) -> list[tuple[str, bytes]]:
        routes = self._agents.get(agent_id)
        if routes is None:
            return []
        ordered = sorted(routes.by_carrier.items(), key=lambda kv: kv[1][1], reverse=True)
        return [(carrier, rid) for carrier, (rid, _) in ordered]

    # ------------------------------------------------------------------ sending

    def send_control(self, carrier: CarrierIngress, routing_id: bytes, frames: list[bytes]) -> None:
        """Acks, pongs and rejections go back on the carrier the frame came in on."""
        result = carrier.send(routing_id, frames)
        if result != SendResult.SENT:
            self._metrics.child(self._metrics.replies_undeliverable, f"control_{result}").inc()

    def respond(self, agent_id: str, response: bytes) -> None:
        """Queue a response; all responses of one loop tick to one agent travel in one frame."""
        self._outbox.setdefault(agent_id, []).append(response)
        self._schedule()

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        for agent_id, responses in outbox.items():
            for start in range(0, len(responses), MAX_RESPONSES_PER_FRAME):
                chunk = responses[start : start + MAX_RESPONSES_PER_FRAME]
                if not self._deliver(agent_id, chunk):
                    self._park(agent_id, chunk)

    def _deliver(self, agent_id: str, responses: list[bytes]) -> bool:
        routes = self._routes(agent_id)
        if not routes:
            return False
        payload = repeated_field(RESPONSES_FIELD, responses)
        frames = self._codec.encode(
            Serialized(pb.MESSAGE_KIND_RESPONSE_BATCH, payload, len(responses)),
            agent_id=agent_id,
            region="hk",
            dict_id=0,
        )
        for carrier_name, routing_id in routes:
            carrier = self._carriers.get(carrier_name)
            if carrier is None:
                continue
            result = carrier.send(routing_id, frames)
            if result == SendResult.SENT:
                return True
            self._metrics.child(self._metrics.replies_undeliverable, result).inc()
            if result == SendResult.UNREACHABLE:
                self._forget(agent_id, carrier_name, routing_id)
        return False

    def _forget(self, agent_id: str, carrier: str, routing_id: bytes) -> None:
        routes = self._agents.get(agent_id)
        if routes is not None and routes.by_carrier.get(carrier, (b"", 0.0))[0] == routing_id:
            del routes.by_carrier[carrier]

    def _routes_of(self, agent_id: str) -> _AgentRoutes:
        """The agent's entry, most recently used last; the least recently seen agent beyond the bound goes."""
        routes = self._agents.get(agent_id)
        if routes is None:
            routes = self._agents[agent_id] = _AgentRoutes()
            while len(self._agents) > self._config.pending_agents:
                _, dropped = self._agents.popitem(last=False)
                self._drop_pending(dropped, "agent_evicted")
        else:
            self._agents.move_to_end(agent_id)
        return routes

    def _park(self, agent_id: str, responses: list[bytes]) -> None:
        routes = self._routes_of(agent_id)
        limit = self._config.pending_per_agent
        for response in responses:
            if len(routes.pending) >= limit:
                routes.pending.popleft()
                self.pending_total -= 1
                self._metrics.child(self._metrics.replies_undeliverable, "pending_full").inc()
            routes.pending.append(response)
            self.pending_total += 1
        self._metrics.pending_replies.set(self.pending_total)

    def _drop_pending(self, routes: _AgentRoutes, reason: str) -> None:
        if routes.pending:
            self._metrics.child(self._metrics.replies_undeliverable, reason).inc(len(routes.pending))
            self.pending_total -= len(routes.pending)
            routes.pending.clear()
            self._metrics.pending_replies.set(self.pending_total)
