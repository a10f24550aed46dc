"""The link between the front and its shards: a DEALER per shard, connected to one ROUTER of the front's
over ``ipc://`` in the gateway's runtime directory. The front addresses a shard by its routing id
(:func:`shard_routing_id`).

Messages, front -> shard (the first part says what the rest is):

- ``F`` + carrier index: an agent's message, raw: ``[tag, agent routing id, User-Id, Peer-Address,
  envelope, payload]``. User-Id is what the front's ZAP handler admitted (empty in plaintext); Peer-Address
  is sent only in plaintext, where it is the region's only source (GeoIP).
- ``Q``: ``[tag, scrape id]``, send your metrics now.
- ``C``: ``[tag, JSON]``, an admin command (``{"capture_s": seconds}``).

shard -> front:

- ``R`` + carrier index: ``[tag, agent routing id, reply parts...]``, send this to the agent on that
  carrier.
- ``S``: ``[tag, JSON]``, the shard's status (ready, tiers, draining, pid), every health interval: the
  front's sign that the shard is alive.
- ``M``: ``[tag, scrape id, exposition text]``.
- ``H`` + carrier index: ``[tag, agent routing id, the envelope's agent id, seconds]``, the shard's budget
  holds this connection for that long (gateway/ingress/budget.py HeldConnections): the front refuses its
  request batches naming that agent itself and paces its reading (gateway/shards/holds.py).

The shard side is here (:class:`ShardLink`, and a :class:`LinkedCarrier` per carrier that the shard's
ingest and replies use as they would a ROUTER of their own); the front side is gateway/shards/front.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import zmq
import zmq.asyncio

from edgewire.parts import send_parts
from gateway.config import ZmqConfig
from gateway.ingress.carrier import OnMessage, SendResult, silent_after_s
from gateway.ingress.reader import EdgeReader
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.shards")

FRAME, REPLY, STATUS, METRICS, QUERY, COMMAND, HOLD = b"F", b"R", b"S", b"M", b"Q", b"C", b"H"
LINK_HWM = 100_000
"""Messages queued on the link each way: above a carrier's HWM, so the link is never what drops first."""


def shard_routing_id(index: int) -> bytes:
    return b"shard-%d" % index


def tag(kind: bytes, carrier_index: int) -> bytes:
    return kind + bytes((carrier_index,))


def link_socket_options(sock: zmq.Socket[Any], zcfg: ZmqConfig) -> None:
    """Both ends: deep queues, no linger beyond the carriers' own."""
    sock.setsockopt(zmq.SNDHWM, LINK_HWM)
    sock.setsockopt(zmq.RCVHWM, LINK_HWM)
    sock.setsockopt(zmq.LINGER, zcfg.linger_ms)


@dataclass(frozen=True, slots=True)
class ShardRole:
    """What makes a gateway process a shard: its index among ``count``, and the front's link endpoint."""

    index: int
    count: int
    link: str


class LinkedCarrier:
    """A carrier as a shard sees it: frames arrive over the link, replies go back over it."""

    def __init__(self, name: str, index: int, link: ShardLink) -> None:
        self.name = name
        self.index = index
        self._link = link
        self._reply_tag = tag(REPLY, index)
        self._hold_tag = tag(HOLD, index)

    @property
    def endpoint(self) -> str:
        return f"front:{self.name}"

    @property
    def silent_after_s(self) -> float:
        return silent_after_s(self._link.zmq_config)

    @property
    def bound(self) -> bool:
        return self._link.connected

    @property
    def receiving(self) -> bool:
        return self._link.connected

    def more_waiting(self) -> bool:
        return self._link.more_waiting()

    def pause_reading(self, seconds: float) -> bool:
        """Nothing: the front reads the carrier's ROUTER, and the link carries every agent's frames (pausing
        it would hold them all). The front paces a held connection's frames itself (:meth:`hold`)."""
        return False

    def hold(self, routing_id: bytes, agent_id: str, seconds: float) -> None:
        """Tell the front: it refuses this connection's request batches naming ``agent_id`` for ``seconds``
        and paces its reading of them (gateway/shards/holds.py)."""
        self._link.send([self._hold_tag, routing_id, agent_id.encode(), repr(seconds).encode()])

    def stalled(self, now: float, stall_s: float) -> bool:
        return False  # the front judges its carriers; a shard that stops reading stops reporting status

    def peer_property(self, header: zmq.Frame, name: str) -> str:
        return self._link.peer_property(name)

    def send(self, routing_id: bytes, frames: Sequence[bytes | zmq.Frame]) -> str:
        return self._link.send([self._reply_tag, routing_id, *frames])

    async def close(self) -> None:
        return None  # the link is closed once, by its owner


class ShardLink:
    """A shard's end of the link: reads the front's messages and sends its replies, status and metrics."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        role: ShardRole,
        carriers: Sequence[str],
        zmq_config: ZmqConfig,
        metrics: GatewayMetrics,
        on_message: OnMessage,
        on_command: Callable[[Mapping[str, Any]], None],
    ) -> None:
        self._ctx = context
        self.role = role
        self.zmq_config = zmq_config
        self._metrics = metrics
        self._on_message = on_message
        self._on_command = on_command
        self.carriers = {name: LinkedCarrier(name, i, self) for i, name in enumerate(carriers)}
        self._by_index = list(self.carriers.values())
        self._owner: zmq.asyncio.Socket | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._reader: EdgeReader | None = None
        self._properties: dict[str, str] = {}
        self.connected = False

    def start(self) -> None:
        owner = self._ctx.socket(zmq.DEALER)
        owner.setsockopt(zmq.ROUTING_ID, shard_routing_id(self.role.index))
        link_socket_options(owner, self.zmq_config)
        owner.connect(self.role.link)
        self._owner = owner
        self._sock = zmq.Socket.shadow(owner.underlying)
        self._reader = EdgeReader(
            self._sock, self._deliver, self._failed, self.zmq_config.max_messages_per_wakeup
        )
        self._reader.start()
        self.connected = True

    def close(self) -> None:
        self.connected = False
        if self._reader is not None:
            self._reader.stop()
        self._sock = None
        if self._owner is not None:
            self._owner.close(self.zmq_config.linger_ms)
            self._owner = None

    def more_waiting(self) -> bool:
        """Whether another message of the front's waits to be read now (EdgeReader.waiting_now)."""
        return self._reader is not None and self._reader.waiting_now()

    def peer_property(self, name: str) -> str:
        """The property of the agent message being delivered now (delivery is synchronous)."""
        return self._properties.get(name, "")

    def send(self, parts: Sequence[bytes | zmq.Frame]) -> str:
        sock = self._sock
        if sock is None:
            return SendResult.CLOSED
        try:
            send_parts(sock, parts)
        except zmq.Again:
            return SendResult.FULL
        finally:
            if self._reader is not None:
                self._reader.after_send()
        return SendResult.SENT

    def send_status(self, status: Mapping[str, Any]) -> None:
        self.send([STATUS, json.dumps(status).encode()])

    def _failed(self, exc: zmq.ZMQError) -> None:
        self.connected = False
        log.error("shard link receive failed", error=repr(exc))

    def _deliver(self, frames: list[zmq.Frame]) -> None:
        head = frames[0].bytes
        kind = head[:1]
        try:
            if kind == FRAME and len(head) == 2 and len(frames) >= 5 and head[1] < len(self._by_index):
                carrier = self._by_index[head[1]]
                self._properties = {
                    "User-Id": frames[2].bytes.decode(),
                    "Peer-Address": frames[3].bytes.decode(),
                }
                try:
                    self._on_message(carrier, [frames[1], *frames[4:]])
                finally:
                    self._properties = {}
            elif kind == QUERY and len(frames) == 2:
                self.send([METRICS, frames[1].bytes, self._metrics.render()])
            elif kind == COMMAND and len(frames) == 2:
                self._on_command(json.loads(frames[1].bytes))
            else:
                log.error(
                    "shard link: unexpected message from the front", head=head[:8].hex(), parts=len(frames)
                )
        except Exception:  # a bug in handling one message must not stop the link
            self._metrics.ingest_errors.labels("link").inc()
            log.exception("handling a message from the front failed")
