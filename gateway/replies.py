"""Answers to agents: on whichever carrier the agent is reachable through, coalesced per loop tick.

The gateway remembers, per agent, the routing id it last used on each carrier, when it last heard from it
there, and the carrier of its latest request frame. A response goes out on that carrier: the agent sends
its requests on the carrier it finds best, moves them to another when that one fails, and re-asks there
for answers it is still owed (PROTOCOL.md section 12), so the answer follows the agent's requests and not
its pings, which it sends on every carrier, the failed one included when only the way back is broken.

A route the agent has not been heard from for longer than its carrier's ZMTP heartbeat timeout is not used
while another one has been: the agent pings every carrier every ping interval, so such a route is dead (a
black-holed link whose TCP connection still looks up), and libzmq will close it once the heartbeat times
out; answers already sent into it cannot be recalled and are re-asked for by the agent. If the peer is gone
(ROUTER_MANDATORY says so) the next route is tried. An agent reachable on none has its responses kept,
bounded, until it shows up again (any frame, e.g. its next ping), then they are delivered.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
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
    asked_on: str = ""  # the carrier of its latest request frame
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._carriers = carriers
        self._codec = codec
        self._config = config
        self._metrics = metrics
        self._instance = instance
        self._clock = clock  # the clock ``seen`` is given its ``now`` by
        self._agents: OrderedDict[str, _AgentRoutes] = OrderedDict()
        self._outbox: dict[str, list[bytes]] = {}
        self._flush_scheduled = False
        self.pending_total = 0
        # Responses sent on another carrier than the agent's latest request frame came on (that route was
        # silent, gone or full): answers that followed the agent off a failed carrier.
        self.moved = 0

    # ------------------------------------------------------------------ who is where

    def seen(
        self, agent_id: str, carrier: str, routing_id: bytes, now: float, *, asked: bool = False
    ) -> None:
        """An agent spoke on a carrier (``asked``: a request frame): remember the route, deliver anything
        it missed."""
        routes = self._routes_of(agent_id)
        routes.by_carrier[carrier] = (routing_id, now)
        if asked:
            routes.asked_on = carrier
        if routes.pending:
            self._outbox.setdefault(agent_id, []).extend(routes.pending)
            self.pending_total -= len(routes.pending)
            routes.pending.clear()
            self._metrics.pending_replies.set(self.pending_total)
            self._schedule()

    def _routes(self, agent_id: str, now: float) -> list[tuple[str, bytes]]:
        """The routes to try, in order: the carrier the agent last asked on, then the others, most recently
        heard from first; only those heard from within their carrier's heartbeat timeout while any is."""
        routes = self._agents.get(agent_id)
        if routes is None:
            return []
        heard = sorted(routes.by_carrier.items(), key=lambda kv: kv[1][1], reverse=True)
        live = [kv for kv in heard if now - kv[1][1] <= self._silent_after_s(kv[0])]
        candidates = live or heard
        # Stable: the carrier asked on first (when it is a candidate), the rest keep their recency order.
        candidates.sort(key=lambda kv: kv[0] != routes.asked_on)
        return [(carrier, rid) for carrier, (rid, _) in candidates]

    def _silent_after_s(self, carrier: str) -> float:
        ingress = self._carriers.get(carrier)
        return float("inf") if ingress is None else ingress.silent_after_s

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
        routes = self._routes(agent_id, self._clock())
        if not routes:
            return False
        asked_on = self._agents[agent_id].asked_on
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
                if asked_on and carrier_name != asked_on:
                    self.moved += len(responses)
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
