"""Each agent's cost budget at ingest: what its frames may make the gateway decompress and decode.

A 1 KB frame may honestly declare 32 MiB of zeros: it passes every limit of the codec
(``max_decompressed_bytes`` bounds one frame, not a rate) and costs the event loop tens of milliseconds
to decompress, during which no other agent's frame is read. A flood of them from one agent starves the
rest. So each agent has two token buckets, as Envoy's overload manager and NATS account limits charge a
peer for what it costs:

* **bytes**: the bytes its zstd frames decompress to, refilled at ``bytes_per_s`` up to ``burst_bytes``.
  A frame larger than ``large_frame_bytes`` costs more than its size: ``size x size / large_frame_bytes``.
  Its decompression holds the loop in one piece, and what that does to the others grows with the square
  of its length (more of their frames wait, each longer); an agent's own frames are cut at about 1 MiB
  (its ``batching.max_bytes``), so only a frame no agent sends pays the square. Payloads sent raw
  (``CODEC_NONE``) are not decompressed and cost no bytes here: their bytes came over the wire.
* **decode time**: CPU seconds spent decoding its frames (the event loop's; for a large zstd payload, the
  inflate thread's too: gateway/ingress/inflate.py), refilled at ``decode_s_per_s`` (a share of one
  core) up to ``burst_decode_s``.

Admission (:meth:`AgentBudgets.admit`) is decided before decompression, from the envelope's declared
``uncompressed_length`` (which the codec later holds the payload to) and the balances: the frame goes
ahead when the bytes bucket holds its cost (or is full, for a frame costing more than the bucket holds)
and the decode bucket is not in debt. Otherwise it is refused, and the answer is how long until it would
be admitted: the retry-after the agent is told. An admitted frame's bytes are charged at once
(:meth:`AgentBudgets.charge`: the agent's next frames are admitted against them, also while this one waits
for its decode), its decode time afterwards, with what the decode really took; a frame may drive a bucket
into debt (its decode time is not known before), and an agent in debt is refused until the refill has paid
it back.

Pure logic: no sockets, no logging; the clock is the caller's (``now``) or the injected one.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from edgewire import FrameError, pb
from gateway.config import BudgetConfig

CONTROL_FREE_BYTES: Final = 4096
"""A Ping or DictionaryRequest declaring at most this much is always admitted (and charged): the gateway
answers no refused control frame (PROTOCOL.md section 7), so refusing one would read to the agent as a
lost Pong, and a few of those as a dead carrier. Real ones are tens of bytes."""
BUDGETED_KINDS: Final = frozenset(
    {pb.MESSAGE_KIND_REQUEST_BATCH, pb.MESSAGE_KIND_PING, pb.MESSAGE_KIND_DICTIONARY_REQUEST}
)
"""The kinds whose payload the gateway decodes; frames of other kinds are refused before that."""
MAX_RETRY_AFTER_MS: Final = (1 << 32) - 1  # the wire field is a uint32
TOLD_PER_HOLD: Final = 64
"""Over-budget refusals answered with an Ack while an agent is held back (from its first refusal until the
retry-after that refusal gave). An agent honouring it sent at most its frames already in flight (its send
window) in that time; the rest come from one that does not listen, and an Ack each would cost the loop
more than the refusal itself: they are counted and dropped, as an Ack lost would be (the agent resends
after its ack timeout)."""
OVER_BUDGET: Final = FrameError(pb.REJECT_REASON_OVER_BUDGET, "agent over its cost budget")
"""The refusal, counted and logged like every other; the wait is the Ack's ``frame_retry_after_ms``."""


@dataclass(slots=True)
class _Buckets:
    bytes: float
    decode_s: float
    at: float  # when both were last refilled
    held_until: float = 0.0  # the retry-after of the first refusal of the current hold
    told: int = 0  # refusals answered with an Ack in the current hold


class AgentBudgets:
    """The two token buckets of every agent seen recently (at most ``config.max_agents``: the least
    recently seen is forgotten first, and comes back with full buckets).

    With ``config.enabled`` false every frame is admitted and nothing is tracked.
    """

    def __init__(self, config: BudgetConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.enabled = config.enabled
        self._clock = clock
        self._agents: OrderedDict[str, _Buckets] = OrderedDict()
        self.evicted = 0  # agents forgotten to stay within max_agents

    def __len__(self) -> int:
        return len(self._agents)

    def cost(self, decompressed_bytes: int) -> float:
        """What decompressing ``decompressed_bytes`` in one frame costs the bytes bucket."""
        large = self.config.large_frame_bytes
        return decompressed_bytes * max(1.0, decompressed_bytes / large)

    def admit(
        self, agent_id: str, declared_bytes: int, now: float | None = None, *, control: bool = False
    ) -> float | None:
        """None: decode the frame. Else the seconds until the agent's buckets would admit it.

        ``declared_bytes``: what the frame will decompress to (the envelope's ``uncompressed_length`` of a
        zstd payload, 0 for a raw one); ``control``: a Ping or a DictionaryRequest (small ones always go
        ahead, see :data:`CONTROL_FREE_BYTES`).
        """
        if not self.enabled or (control and declared_bytes <= CONTROL_FREE_BYTES):
            return None
        buckets = self._buckets(agent_id, self._clock() if now is None else now)
        wait = self._wait(buckets, self.cost(declared_bytes))
        return wait if wait > 0 else None

    def take(
        self, agent_id: str, declared_bytes: int, now: float | None = None, *, control: bool = False
    ) -> float | None:
        """:meth:`admit`, and a frame admitted charged its declared bytes at once (:meth:`charge`, no decode
        time yet), with one look-up of the agent's buckets: what the gateway does as a frame's turn comes."""
        if not self.enabled:
            return None
        buckets = self._buckets(agent_id, self._clock() if now is None else now)
        cost = self.cost(declared_bytes)
        if not (control and declared_bytes <= CONTROL_FREE_BYTES):
            wait = self._wait(buckets, cost)
            if wait > 0:
                return wait
        buckets.bytes -= cost
        return None

    def _wait(self, buckets: _Buckets, cost: float) -> float:
        """Seconds until ``buckets`` admit a frame costing ``cost`` (0 or less: now)."""
        cfg = self.config
        need = min(cost, cfg.burst_bytes)  # more than the bucket: wait for a full one
        return max((need - buckets.bytes) / cfg.bytes_per_s, -buckets.decode_s / cfg.decode_s_per_s)

    def charge(
        self, agent_id: str, decompressed_bytes: int, decode_s: float, now: float | None = None
    ) -> None:
        """What an admitted frame cost: the bytes it decompressed to (0 for a raw payload) and the time
        its decode took."""
        if not self.enabled:
            return
        buckets = self._buckets(agent_id, self._clock() if now is None else now)
        buckets.bytes -= self.cost(decompressed_bytes)
        buckets.decode_s -= max(0.0, decode_s)

    def tell(self, agent_id: str, retry_after_s: float, now: float | None = None) -> bool:
        """Whether a refusal :meth:`admit` just made is answered with an Ack: the first
        :data:`TOLD_PER_HOLD` of a hold are, the rest of it are not."""
        buckets = self._agents.get(agent_id)
        if buckets is None:
            return True
        now = self._clock() if now is None else now
        if now >= buckets.held_until:
            buckets.held_until, buckets.told = now + retry_after_s, 0
        buckets.told += 1
        return buckets.told <= TOLD_PER_HOLD

    def hold_ends(self, agent_id: str) -> float:
        """When the agent's current hold ends (the retry-after of its first refusal in it); 0 if none."""
        buckets = self._agents.get(agent_id)
        return 0.0 if buckets is None else buckets.held_until

    def balance(self, agent_id: str, now: float | None = None) -> tuple[float, float] | None:
        """(bytes, decode seconds) the agent's buckets hold now; None for an agent not tracked."""
        buckets = self._agents.get(agent_id)
        if buckets is None:
            return None
        self._refill(buckets, self._clock() if now is None else now)
        return buckets.bytes, buckets.decode_s

    def _buckets(self, agent_id: str, now: float) -> _Buckets:
        buckets = self._agents.get(agent_id)
        if buckets is None:
            cfg = self.config
            buckets = self._agents[agent_id] = _Buckets(float(cfg.burst_bytes), cfg.burst_decode_s, now)
            if len(self._agents) > cfg.max_agents:
                self._agents.popitem(last=False)
                self.evicted += 1
            return buckets
        self._agents.move_to_end(agent_id)
        self._refill(buckets, now)
        return buckets

    def _refill(self, buckets: _Buckets, now: float) -> None:
        elapsed = now - buckets.at
        if elapsed <= 0:  # same instant, or a clock that stepped back: nothing accrues
            return
        cfg = self.config
        buckets.bytes = min(float(cfg.burst_bytes), buckets.bytes + elapsed * cfg.bytes_per_s)
        buckets.decode_s = min(cfg.burst_decode_s, buckets.decode_s + elapsed * cfg.decode_s_per_s)
        buckets.at = now


MAX_HELD: Final = 4096
"""Held connections remembered (:class:`HeldConnections`); beyond it the oldest are forgotten (their frames
take the whole path again, and are refused there)."""
LAPSED_KEEP_S: Final = 60.0
"""How long a connection whose hold ended is still remembered (:meth:`HeldConnections.state`): its agent
ignored that hold, so its request batches there are checked against its budget as they are read, and one
the budget would refuse holds the connection again at once, instead of being read into the backlog with
the rest of its flood and refused there (its reads a burst of the loop's time every time a hold ends:
bench/budget_attack.py, a victim's slowest requests came 4 s apart, at each hold's end)."""


class HeldConnections:
    """Connections whose agent kept sending past the :data:`TOLD_PER_HOLD` answered refusals of a hold:
    until the hold ends, their request batches are refused right after the envelope is read (not its
    identity, reply route or buckets), whatever they declare; for :data:`LAPSED_KEEP_S` after it ends the
    connection is remembered as lapsed (the caller checks its frames against the budget as they are read).

    Keyed by (carrier, routing id): a ROUTER's routing ids are its own, one per connection. A held
    connection is refused only frames naming the agent it was held for; anything else on it takes the whole
    path. At most ``limit`` are remembered, the oldest forgotten first. Pure: the caller's clock.
    """

    __slots__ = ("_held", "limit")

    def __init__(self, limit: int = MAX_HELD) -> None:
        self.limit = limit
        # -> (the envelope's agent id, the agent whose budget it is, the hold's end)
        self._held: dict[tuple[str, bytes], tuple[str, str, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def held_now(self, now: float) -> int:
        """How many connections are held at ``now`` (not the lapsed ones remembered): the
        ``hkgw_held_connections`` gauge, read on the HTTP thread at a scrape (``list`` of a dict's values is
        one step under the GIL, so the loop's changes meanwhile cannot break it)."""
        return sum(1 for _, _, until in list(self._held.values()) if until > now)

    def connections(self) -> list[tuple[str, bytes]]:
        """The remembered connections (held or lapsed), oldest hold first."""
        return list(self._held)

    def hold(
        self, carrier: str, routing_id: bytes, agent_id: str, until: float, owner: str | None = None
    ) -> None:
        """Hold the connection for frames naming ``agent_id`` (the envelope's) until ``until``; ``owner``: the
        agent whose budget it is (the key's under CurveZMQ; default ``agent_id``). A connection held again
        moves to the newest."""
        held = self._held
        held.pop((carrier, routing_id), None)
        held[(carrier, routing_id)] = (agent_id, agent_id if owner is None else owner, until)
        while len(held) > self.limit:
            del held[next(iter(held))]

    def state(self, carrier: str, routing_id: bytes, agent_id: str, now: float) -> tuple[float, str] | None:
        """(the hold's end, its budget's agent) for a request batch naming ``agent_id`` on this connection, if
        it is held (``now`` before the end: the batch is refused) or lapsed (after it, within
        :data:`LAPSED_KEEP_S`); None otherwise. A hold lapsed longer than that is forgotten."""
        held = self._held.get((carrier, routing_id))
        if held is None or agent_id != held[0]:
            return None
        if now >= held[2] + LAPSED_KEEP_S:
            del self._held[(carrier, routing_id)]
            return None
        return held[2], held[1]

    def remembers(self, carrier: str, routing_id: bytes) -> bool:
        """Whether the connection is remembered, held or lapsed (for any agent): one look-up, before the
        envelope is read for :meth:`state`."""
        return (carrier, routing_id) in self._held

    def release(self, carrier: str, routing_id: bytes) -> None:
        """Forget the connection's hold, if any."""
        self._held.pop((carrier, routing_id), None)

    def clear(self) -> None:
        """Forget every hold."""
        self._held.clear()


HELD_READS_BURST: Final = 32
"""Held connections' frames read at once before :class:`HeldReadPace` paces them."""
MAX_HELD_PAUSE_S: Final = 0.001
"""The longest pause :class:`HeldReadPace` asks for (at the slowest pace allowed, 100 frames a second,
one frame's: 10 ms): the debt it runs up stops there. Every other connection of the carrier waits out a
pause, and the event loop's timers count whole milliseconds (uvloop rounds a shorter one to the next
iteration), so the pace is kept by pausing a millisecond after a few frames, not a fifth of one after
each. A debt of a whole burst let pauses reach 6.4 ms at 5,000 a second: a victim's p99 behind a
full-rate flood 6.8 ms against 2.4 unattacked (bench/budget_attack.py)."""


class HeldReadPace:
    """How fast a carrier's ROUTER may read frames that held connections keep sending: a token bucket per
    carrier, refilled at ``per_s`` up to :data:`HELD_READS_BURST` (``per_s`` 0: not paced).

    A held frame is refused as soon as its envelope is read, but reading it still costs the loop ~10 us, and
    an agent that ignores its retry-after sends as fast as the gateway reads: at full rate that is the whole
    loop (bench/budget_attack.py). A ROUTER cannot stop reading one connection, so its reader pauses
    (EdgeReader.pause) for what the held frame overdrew: the attacker's frames then wait in ZeroMQ's queue
    and its sends stop at the high-water mark. The others lose little: a ROUTER reads its connections in
    turn, a message of each, so their frames wait a pause of ``1 / per_s`` or two (one whose connection
    had run dry comes after the held one's next frame), and during an attack every other connection is read
    about as often as the held one. Only frames the reader reads count (:meth:`take` from the read), not
    those a backlog holds from before the hold: pacing the reader for those would hold everyone else back.
    Pure: the caller's clock.
    """

    __slots__ = ("_buckets", "per_s")

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self._buckets: dict[str, tuple[float, float]] = {}  # carrier -> (tokens, when last refilled)

    def take(self, carrier: str, now: float) -> float:
        """Count one held frame read on ``carrier``: how long its reader should pause before it reads on (0:
        not at all)."""
        per_s = self.per_s
        if per_s <= 0:
            return 0.0
        tokens, at = self._buckets.get(carrier, (float(HELD_READS_BURST), now))
        tokens = min(float(HELD_READS_BURST), tokens + max(0.0, now - at) * per_s) - 1.0
        tokens = max(tokens, -max(1.0, per_s * MAX_HELD_PAUSE_S))  # no pause longer than that
        self._buckets[carrier] = (tokens, now)
        return 0.0 if tokens >= 0 else -tokens / per_s


def retry_after_ms(retry_after_s: float) -> int:
    """The wire's retry-after for a wait: whole milliseconds, rounded up (never 0: 0 means none)."""
    return max(1, min(MAX_RETRY_AFTER_MS, math.ceil(retry_after_s * 1000)))


def over_budget_ack(message_id: bytes, retry_after_s: float) -> pb.Ack:
    """The Ack that refuses the frame ``message_id`` whole and says when the agent may send again."""
    return pb.Ack(
        acked_message_id=message_id,
        frame_reject=OVER_BUDGET.reason,
        frame_reject_detail=OVER_BUDGET.detail,
        frame_retry_after_ms=retry_after_ms(retry_after_s),
    )
