"""Held connections at the front: an agent's connection that its shard's budget holds (gateway/ingress/
budget.py HeldConnections) has its request batches refused by the front, which reads them at
``[budget] held_reads_per_s``.

With shards, the front's relay thread reads every carrier's ROUTER and the shards see frames only over the
link. A shard that holds a connection (its agent ignored the retry-after of ``TOLD_PER_HOLD`` refusals)
could refuse the flood but not slow its reading: before this, every frame of a full-rate flood was read by
the relay, passed over the link and refused by the shard, which took one core for the refusals and one
more for the relay (bench/budget_attack.py ``--shards 2``). Now the shard tells the front of each hold
(link message ``H``, gateway/shards/link.py) and the front refuses the connection's request batches that
name the held agent as soon as their envelope is read, counted as the shard would
(``hkgw_frames_rejected_total{reason="over_budget"}``), and pauses its reading of that carrier for what
they overdraw of the pace (``hkgw_carrier_read_pauses_total``), as a single-process gateway's reader does.

When a hold ends, the connection's frames go to the shard again, still read at the pace for a minute
(``LAPSED_KEEP_S``): the shard's budget admits them, or holds the connection again and tells the front. A
reload (keys may be revoked or remapped) and a capture (which sees every frame whole) forget every hold
here, as they do in the shards.

Only the relay thread calls :meth:`FrontHolds.hold` and :meth:`FrontHolds.check`; :meth:`FrontHolds.clear`
may be called from any thread (it is done by the relay thread at its next call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog
import zmq
from google.protobuf.message import DecodeError

from edgewire import pb
from gateway.ingress.budget import OVER_BUDGET, HeldConnections, HeldReadPace
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.front")

MAX_HOLD_S = 3600.0
"""The longest hold a shard's message may set (a retry-after is far shorter); a longer one is cut to it."""


class FrontHolds:
    """The front's held connections and the pace of reading them, per carrier."""

    def __init__(
        self,
        carriers: Sequence[str],
        held_reads_per_s: float,
        metrics: GatewayMetrics,
        max_header_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._carriers = list(carriers)
        self._held = HeldConnections()
        self._pace = HeldReadPace(held_reads_per_s)
        self._clock = clock
        self._max_header = max_header_bytes
        self._clear_asked = False
        self._rejected = {c: metrics.frames_rejected.labels(c, OVER_BUDGET.label) for c in carriers}
        self._pauses = {c: metrics.read_pauses.labels(c) for c in carriers}

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        """Forget every hold (reload, capture): done by the relay thread before it next reads a hold."""
        self._clear_asked = True

    def _cleared(self) -> None:
        if self._clear_asked:
            self._clear_asked = False
            self._held.clear()

    def hold(self, parts: Sequence[zmq.Frame]) -> bool:
        """A shard's ``H`` message (after the shard's routing id): ``[tag, agent routing id, the envelope's
        agent id, seconds]``; False when malformed (nothing held)."""
        self._cleared()
        if len(parts) != 4 or len(parts[0]) != 2 or parts[0].bytes[1] >= len(self._carriers):
            return False
        try:
            agent = parts[2].bytes.decode()
            seconds = float(parts[3].bytes)
        except ValueError:
            return False
        if not 0.0 <= seconds < float("inf"):
            return False
        if seconds == 0.0:
            return True  # a hold that ends now: nothing to hold
        carrier = self._carriers[parts[0].bytes[1]]
        routing_id = parts[1].bytes
        self._held.hold(carrier, routing_id, agent, self._clock() + min(seconds, MAX_HOLD_S))
        log.debug("connection held at the front", carrier=carrier, agent=agent, seconds=round(seconds, 3))
        return True

    def check(self, carrier: str, frames: Sequence[zmq.Frame]) -> tuple[bool, float] | None:
        """An agent's message ``[routing id, envelope, payload]`` read on ``carrier``: None when it is not a
        request batch of a held connection naming the held agent (pass it on); else (refused, how long the
        carrier's reading should pause, 0: not at all). Held: refused and counted. Lapsed (its hold ended
        within ``LAPSED_KEEP_S``, a minute): passed on, for the shard's budget to admit or hold it again,
        but read at the same pace: the flood that waited in ZeroMQ during the hold would otherwise go to the
        shard as fast as the relay reads it, thousands of frames before the shard's new hold reaches here,
        each one refused on the loop of the shard that also serves every other agent placed there
        (bench/budget_attack.py ``--victim-shard same``)."""
        self._cleared()
        if not self._held or len(frames) < 2:
            return None
        routing_id = frames[0].bytes
        if not self._held.remembers(carrier, routing_id):
            return None
        header = frames[1]
        if len(header) > self._max_header:
            return None  # the shard refuses it, with its reason
        try:
            envelope = pb.Envelope.FromString(header.buffer)  # type: ignore[arg-type]
        except DecodeError:
            return None
        if envelope.kind != pb.MESSAGE_KIND_REQUEST_BATCH:
            return None
        now = self._clock()
        state = self._held.state(carrier, routing_id, envelope.agent_id, now)
        if state is None:
            return None
        refused = now < state[0]
        if refused:
            self._rejected[carrier].inc()
        pause_s = self._pace.take(carrier, now)
        if pause_s > 0:
            self._pauses[carrier].inc()
        return refused, pause_s
