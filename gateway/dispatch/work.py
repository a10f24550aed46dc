"""A request on its way through the gateway, from acceptance to its response."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from edgewire import pb
from routing.types import Decision, Priority

SMALL_FRAME: Final = 8
"""At most this many requests make a frame small: a lone request, a caller's few (a flood: tens, hundreds)."""
PRIORITY_ORDER: dict[Priority, int] = {Priority.REALTIME: 0, Priority.INTERACTIVE: 1, Priority.BATCH: 2}
LEAST_URGENT: Final = 2
"""The batch lane (PRIORITY_ORDER's): no lane is less urgent."""
WIRE_PRIORITY: dict[Priority, pb.PriorityClass.ValueType] = {
    Priority.REALTIME: pb.PRIORITY_CLASS_REALTIME,
    Priority.INTERACTIVE: pb.PRIORITY_CLASS_INTERACTIVE,
    Priority.BATCH: pb.PRIORITY_CLASS_BATCH,
}


@dataclass(slots=True)
class WorkItem:
    """One accepted request. Times are the gateway's monotonic clock."""

    request: pb.InferRequest
    agent_id: str
    region: str
    carrier: str
    priority: Priority
    received: float
    deadline: float | None  # monotonic; None = no deadline
    decision: Decision
    text_tokens: int = 0  # a text request's estimated tokens (its profile's): the pool's length bucket
    raw: memoryview | None = None  # the request's bytes in the frame it came in (None: serialize it)
    urgent: bool = False  # in a frame marked realtime: its answer is sent once its batch is (pool.py)
    small: bool = False  # in a frame of at most SMALL_FRAME requests: batched apart (lanes.py take_batch)
    enqueued: float = 0.0
    attempts: int = 0  # backend attempts so far (a retry goes to another pool)
    answered: bool = False  # set once its response is out: a request is never answered twice

    @property
    def model(self) -> str:
        return self.request.model_name

    @property
    def version(self) -> str:
        return self.request.model_version

    def remaining(self, now: float) -> float | None:
        return None if self.deadline is None else self.deadline - now
