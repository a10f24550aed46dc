"""A served batch's answers, assembled per group instead of built request by request.

The requests of one frame that one decision routed share every response field but their id and outputs:
status, model and version, tier, pool and route reason, and their timing (one batch: the same
pre-processing, inference and post-processing times; one frame: received and queued together). Those
fields are serialized once per group (the *head*); an answer is its id, the head and its outputs, joined
(protobuf merges concatenated encodings of one message, so this is the response the fields would make).
"""

from __future__ import annotations

from typing import Final

from edgewire import pb
from gateway.dispatch.work import WorkItem

TIER_WIRE: Final = {
    "edge_device": pb.TIER_EDGE_DEVICE,
    "edge_server": pb.TIER_EDGE_SERVER,
    "cloud": pb.TIER_CLOUD,
}
_ID_FIELD: Final = b"\x0a\x10"  # InferResponse.request_id (field 1, length-delimited), 16 bytes
assert pb.InferResponse.DESCRIPTOR.fields_by_name["request_id"].number == 1


class ResponseHeads:
    """The heads of one batch's OK answers, one per (decision, received, enqueued), and what the metrics
    count per group (:meth:`totals`): responses per (tier, pool) and latencies per (tier, pool, latency).

    A batch holds whole slices of frames, so consecutive answers mostly share their group: a run of them
    reuses the head and is counted once, when the run ends."""

    __slots__ = (
        "_heads",
        "_model",
        "_now",
        "_run",
        "_run_head",
        "_run_latency",
        "_run_n",
        "_started",
        "_timing",
        "_version",
        "counts",
        "latencies",
    )

    def __init__(self, model: str, version: str, timing: pb.ServerTiming, started: float, now: float) -> None:
        self._model = model
        self._version = version
        self._timing = timing
        self._started = started
        self._now = now
        self._heads: dict[tuple[int, float, float], bytes] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.latencies: dict[tuple[str, str, float], int] = {}
        self._run: tuple[object, float, float] | None = None  # (decision, received, enqueued) of the run
        self._run_head = b""
        self._run_latency: tuple[str, str, float] = ("", "", 0.0)
        self._run_n = 0

    def answer(self, item: WorkItem, request_id: bytes, outputs: bytes) -> bytes:
        """The serialized response of ``item``: its id, its group's head, its outputs."""
        run = self._run
        if (
            run is not None
            and item.decision is run[0]
            and item.received == run[1]
            and item.enqueued == run[2]
        ):
            self._run_n += 1
            head = self._run_head
        else:
            head = self._start_run(item)
        if len(request_id) != 16:  # the gateway accepts only 16-byte ids; anything else is spelt out
            return pb.InferResponse(request_id=request_id).SerializeToString() + head + outputs
        return b"".join((_ID_FIELD, request_id, head, outputs))

    def totals(self) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str, float], int]]:
        """Responses per (tier, pool) and observations per (tier, pool, latency) of every answer so far."""
        self._end_run()
        return self.counts, self.latencies

    def _start_run(self, item: WorkItem) -> bytes:
        self._end_run()
        decision = item.decision
        key = (id(decision), item.received, item.enqueued)
        elapsed = self._now - item.received
        head = self._heads.get(key)
        if head is None:
            timing = pb.ServerTiming()
            timing.CopyFrom(self._timing)
            timing.queue_us = int(max(0.0, self._started - item.enqueued) * 1e6)
            timing.total_us = int(elapsed * 1e6)
            head = self._heads[key] = pb.InferResponse(
                status=pb.STATUS_OK,
                model_name=self._model,
                model_version=self._version,
                tier=TIER_WIRE[decision.tier],  # StrEnums: a member is its value's str
                pool=decision.pool or "",
                route_reason=decision.reason,
                timing=timing,
            ).SerializeToString()
        self._run = (decision, item.received, item.enqueued)
        self._run_head = head
        self._run_latency = (decision.tier, decision.pool or "none", elapsed)
        self._run_n = 1
        return head

    def _end_run(self) -> None:
        n = self._run_n
        if not n:
            return
        latency = self._run_latency
        group = (latency[0], latency[1])
        self.counts[group] = self.counts.get(group, 0) + n
        self.latencies[latency] = self.latencies.get(latency, 0) + n
        self._run_n = 0
        self._run = None
