"""Answers to agents: on whichever carrier the agent is reachable through, coalesced per loop tick.

The gateway remembers, per agent, the routing id it last used on each carrier and when it last heard from
the agent there. A response goes out on the carrier its request came on, or the one the agent last asked
for it again on (a re-ask after a failover, PROTOCOL.md section 12): the agent re-asks for exactly the
requests whose carrier it lost, so an answer sent into a carrier that then fails is always asked for
again. Not on the carrier the agent was heard on last: that is usually a ping, which the agent sends on
every carrier, the failed one too when only the way back is broken.

A route the agent has not been heard from for longer than its carrier's ZMTP heartbeat timeout is not used
while another one has been: the agent pings every carrier every ping interval, so such a route is dead (a
black-holed link whose TCP connection still looks up), and libzmq will close it once the heartbeat times
out; answers already sent into it cannot be recalled and are re-asked for by the agent. If the peer is gone
(ROUTER_MANDATORY says so) the next route is tried. An agent reachable on none has its responses kept,
bounded, until it shows up again (any frame, e.g. its next ping), then they are delivered.

A frame the agent sent before the one a route was learnt from (by the envelope's ``sent_at_unix_us``, the
agent's own clock, so skew between the two does not matter) does not change that route: after a
black-hole lifts, TCP delivers what the agent had sent into the old connection, which is about to close,
while the agent already speaks on a new one.

An agent whose request frames set ``FEATURE_ACKS_IN_RESPONSES`` gets its Acks in the ResponseBatch that
carries its next answers on the connection the frame came on, when they are ready within ``[replies]
ack_hold_us`` (a lone realtime request: one reply frame, not an Ack and then an answer); else, once that
hold is over, alone. Any other agent gets each Ack as its own frame at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import structlog

from edgewire import FrameCodec, Serialized, pb, repeated_field
from gateway.config import RepliesConfig
from gateway.ingress.carrier import Carrier, SendResult
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.replies")
MAX_RESPONSES_PER_FRAME = 256
RESPONSES_FIELD = pb.ResponseBatch.DESCRIPTOR.fields_by_name["responses"].number
ACKS_FIELD = pb.ResponseBatch.DESCRIPTOR.fields_by_name["acks"].number


@dataclass(slots=True)
class _Route:
    routing_id: bytes
    seen: float  # when last heard from on it (monotonic)
    sent_us: int  # the agent's sent_at of that frame


@dataclass(slots=True)
class _PendingAck:
    carrier: Carrier
    routing_id: bytes  # the connection the acknowledged frame came on
    ack: bytes  # serialized
    due: float  # by then it goes, alone if no answer came to ride with (the router's clock)


@dataclass(slots=True)
class _AgentRoutes:
    by_carrier: dict[str, _Route] = field(default_factory=dict)
    pending: deque[bytes] = field(default_factory=deque)  # serialized responses


class ReplyRouter:
    """Finds a way back to each agent and sends it its responses."""

    def __init__(
        self,
        carriers: Mapping[str, Carrier],
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
        self._clock = clock  # the one the ``now`` given to ``seen`` comes from
        self._agents: OrderedDict[str, _AgentRoutes] = OrderedDict()
        self._outbox: dict[tuple[str, str], list[bytes]] = {}  # (agent, carrier asked on) -> responses
        self._acks: dict[tuple[str, str], list[_PendingAck]] = {}  # (agent, carrier) -> Acks to go with them
        self._flush_handle: asyncio.Handle | None = None  # the tick's flush, queued
        self._ack_hold_s = config.ack_hold_us / 1e6
        self._ack_timer: asyncio.TimerHandle | None = None
        self.pending_total = 0

    # ------------------------------------------------------------------ who is where

    def seen(self, agent_id: str, carrier: str, routing_id: bytes, now: float, *, sent_us: int = 0) -> None:
        """An agent spoke on a carrier in a frame it sent at ``sent_us`` (its clock; 0: unknown): remember
        the route unless the frame is older than the one it was learnt from, deliver anything it missed."""
        routes = self._routes_of(agent_id)
        route = routes.by_carrier.get(carrier)
        # A silent route takes even an older frame: a clock stepped back must not freeze it.
        if route is None or not sent_us or sent_us >= route.sent_us or self._silent(route, carrier, now):
            routes.by_carrier[carrier] = _Route(routing_id, now, sent_us)
        if routes.pending:
            self._outbox.setdefault((agent_id, ""), []).extend(routes.pending)
            self.pending_total -= len(routes.pending)
            routes.pending.clear()
            self._metrics.pending_replies.set(self.pending_total)
            self._schedule()

    def _routes(self, agent_id: str, asked_on: str, now: float) -> list[tuple[str, bytes]]:
        """The routes to try, in order: ``asked_on``, then the others, most recently heard from first; only
        those heard from within their carrier's heartbeat timeout while any is."""
        routes = self._agents.get(agent_id)
        if routes is None:
            return []
        heard = sorted(routes.by_carrier.items(), key=lambda kv: kv[1].seen, reverse=True)
        live = [(c, r) for c, r in heard if not self._silent(r, c, now)]
        candidates = live or heard
        # Stable: the carrier asked on first (when it is a candidate), the rest keep their recency order.
        candidates.sort(key=lambda kv: kv[0] != asked_on)
        return [(carrier, route.routing_id) for carrier, route in candidates]

    def _silent(self, route: _Route, carrier: str, now: float) -> bool:
        return now - route.seen > self._silent_after_s(carrier)

    def _silent_after_s(self, carrier: str) -> float:
        ingress = self._carriers.get(carrier)
        return float("inf") if ingress is None else ingress.silent_after_s

    # ------------------------------------------------------------------ sending

    def send_control(self, carrier: Carrier, routing_id: bytes, frames: list[bytes]) -> None:
        """Acks, pongs and rejections go back on the carrier the frame came in on."""
        result = carrier.send(routing_id, frames)
        if result != SendResult.SENT:
            self._metrics.child(self._metrics.replies_undeliverable, f"control_{result}").inc()

    def acknowledge(self, agent_id: str, carrier: Carrier, routing_id: bytes, ack: pb.Ack) -> None:
        """An Ack to an agent that reads Acks in a ResponseBatch: it leaves on the connection its frame came
        on with the next answers for that agent and carrier, or alone once ``ack_hold_us`` is over."""
        pending = _PendingAck(carrier, routing_id, ack.SerializeToString(), self._clock() + self._ack_hold_s)
        acks = self._acks.get((agent_id, carrier.name))
        if acks is None:
            self._acks[(agent_id, carrier.name)] = [pending]
        else:
            acks.append(pending)
        # The tick's flush sends it with the answers ready by then (or at once, with no hold), else arms the
        # hold's timer; a realtime frame's answer takes it before that (send_now), and no timer is made.
        self._schedule()

    def _arm_ack_timer(self, delay_s: float) -> None:
        if self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().call_later(delay_s, self._ack_hold_over)

    def _disarm_ack_timer(self) -> None:
        """Every held Ack went with its answers: nothing left for the hold timer to send."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None

    def _ack_hold_over(self) -> None:
        self._ack_timer = None
        self.flush()

    def respond(self, agent_id: str, response: bytes, asked_on: str = "") -> None:
        """Queue a response to a request asked for on carrier ``asked_on`` ("": any); the responses of one
        loop tick to one agent and carrier travel in one frame."""
        self._outbox.setdefault((agent_id, asked_on), []).append(response)
        self._schedule()

    def respond_many(self, agent_id: str, responses: list[bytes], asked_on: str = "") -> None:
        """:meth:`respond` for several responses to one agent asked for on one carrier."""
        pending = self._outbox.get((agent_id, asked_on))
        if pending is None:
            self._outbox[(agent_id, asked_on)] = responses
        else:
            pending.extend(responses)
        self._schedule()

    def send_now(self, agents: Collection[str]) -> None:
        """Send the answers ready for ``agents`` now, not at the end of the tick (urgent answers), each with
        the Acks held for its agent and carrier (:meth:`flush`'s rules); other agents' answers wait for the
        tick's flush, coalesced as before.

        The flush of a tick is a callback queued behind those queued before it: under a batched load the
        ingest backlog's next turn and the batchers' passes, ~1-3 ms, which realtime answers waited for
        (bench/realtime_under_load.py). Sending only their agents' keeps a flood's answers of the same tick
        in one frame: flushing everything split them once per urgent batch."""
        outbox = self._outbox
        if not outbox:
            return
        # Plain loops: this runs once per realtime batch pass (comprehensions are calls of their own).
        ready: dict[tuple[str, str], list[bytes]] = {}
        for key, responses in outbox.items():
            if key[0] in agents:
                ready[key] = responses
        if not ready:
            return
        acks = self._acks
        now: dict[tuple[str, str], list[bytes]] = {}
        for key, responses in ready.items():
            del outbox[key]
            pending = acks.pop(key, None)
            rest = responses if pending is None else self._send_acks(key[0], key[1], pending, responses)
            if rest:
                now[key] = rest
        if not acks:
            self._disarm_ack_timer()
            if not outbox and self._flush_handle is not None:  # nothing left for the tick's flush
                self._flush_handle.cancel()
                self._flush_handle = None
        self._send(now)

    def _schedule(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self, *, every_ack: bool = False) -> None:
        """Send what is ready: the answers of this tick, and the Acks that have answers to ride with or
        whose hold is over (``every_ack``: all of them, as on drain)."""
        if self._flush_handle is not None:  # flushed before the tick's end (send_now, drain): not again
            self._flush_handle.cancel()
            self._flush_handle = None
        outbox, self._outbox = self._outbox, {}
        if self._acks:
            self._flush_acks(outbox, every_ack)
        self._send(outbox)

    def _send(self, outbox: dict[tuple[str, str], list[bytes]]) -> None:
        """Deliver answers, per agent and carrier asked on, in frames of at most MAX_RESPONSES_PER_FRAME;
        an agent reachable on no route has them kept for it."""
        for (agent_id, asked_on), responses in outbox.items():
            for start in range(0, len(responses), MAX_RESPONSES_PER_FRAME):
                chunk = responses[start : start + MAX_RESPONSES_PER_FRAME]
                if not self._deliver(agent_id, asked_on, chunk):
                    self._park(agent_id, chunk)

    def _flush_acks(self, outbox: dict[tuple[str, str], list[bytes]], every_ack: bool) -> None:
        """Acks that go now, with the answers in ``outbox`` for their agent and carrier (taken from it, but
        for those still to send); the rest wait for their answers or the end of their hold."""
        now = self._clock()
        waiting: dict[tuple[str, str], list[_PendingAck]] = {}
        for key, pending in self._acks.items():
            responses = outbox.pop(key, None)
            if responses is None and not every_ack and pending[0].due > now:
                waiting[key] = pending  # each list is in order of due: its first is the earliest
                continue
            rest = self._send_acks(key[0], key[1], pending, responses or [])
            if rest:
                outbox[key] = rest
        self._acks = waiting
        if waiting:
            self._arm_ack_timer(max(0.0, min(p[0].due for p in waiting.values()) - now))
        else:
            self._disarm_ack_timer()

    def _send_acks(
        self, agent_id: str, carrier: str, pending: list[_PendingAck], responses: list[bytes]
    ) -> list[bytes]:
        """Send a tick's Acks to an agent on one carrier, each group of one connection in one frame, with
        the first answers for that carrier when they would take that connection anyway (the route an
        answer asked for there takes first); the answers still to send."""
        routes = self._routes(agent_id, carrier, self._clock()) if responses else []
        first = routes[0] if routes else None
        by_connection: dict[bytes, list[_PendingAck]] = {}
        for ack in pending:
            by_connection.setdefault(ack.routing_id, []).append(ack)
        for routing_id, group in by_connection.items():
            ingress = group[0].carrier
            riding: list[bytes] = []
            if responses and first == (carrier, routing_id):
                riding, responses = responses[:MAX_RESPONSES_PER_FRAME], responses[MAX_RESPONSES_PER_FRAME:]
            if len(group) == 1 and not riding:
                frames = self._frames(agent_id, pb.MESSAGE_KIND_ACK, group[0].ack, 0)
            else:
                raw = repeated_field(RESPONSES_FIELD, riding) + repeated_field(
                    ACKS_FIELD, [a.ack for a in group]
                )
                frames = self._frames(agent_id, pb.MESSAGE_KIND_RESPONSE_BATCH, raw, len(riding))
            result = ingress.send(routing_id, frames)
            if result == SendResult.SENT:
                continue
            self._metrics.child(self._metrics.replies_undeliverable, f"control_{result}").inc()
            if riding:  # the answers try the agent's other routes; the Acks were for this connection only
                responses = riding + responses
                if result == SendResult.UNREACHABLE:
                    self._forget(agent_id, carrier, routing_id)
        return responses

    def _deliver(self, agent_id: str, asked_on: str, responses: list[bytes]) -> bool:
        routes = self._routes(agent_id, asked_on, self._clock())
        if not routes:
            return False
        payload = repeated_field(RESPONSES_FIELD, responses)
        frames = self._frames(agent_id, pb.MESSAGE_KIND_RESPONSE_BATCH, payload, len(responses))
        for carrier_name, routing_id in routes:
            carrier = self._carriers.get(carrier_name)
            if carrier is None:
                continue
            result = carrier.send(routing_id, frames)
            if result == SendResult.SENT:
                if asked_on and carrier_name != asked_on:
                    self._metrics.replies_moved.inc(len(responses))
                return True
            self._metrics.child(self._metrics.replies_undeliverable, result).inc()
            if result == SendResult.UNREACHABLE:
                self._forget(agent_id, carrier_name, routing_id)
        return False

    def _frames(self, agent_id: str, kind: pb.MessageKind.ValueType, raw: bytes, records: int) -> list[bytes]:
        """A serialized payload framed to an agent (the gateway sends no dictionary-compressed frames)."""
        return self._codec.encode(Serialized(kind, raw, records), agent_id=agent_id, region="hk", dict_id=0)

    def _forget(self, agent_id: str, carrier: str, routing_id: bytes) -> None:
        routes = self._agents.get(agent_id)
        route = routes.by_carrier.get(carrier) if routes is not None else None
        if routes is not None and route is not None and route.routing_id == routing_id:
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
