"""Bounded, lower-case labels of the wire enums, for metrics, logs and summaries (one table per enum)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb


def _labels(enum: Any, prefix: str) -> Mapping[int, str]:
    return {value: enum.Name(value).removeprefix(prefix).lower() for value in enum.values()}


STATUS: Final = _labels(pb.Status, "STATUS_")
NACK: Final = _labels(pb.NackReason, "NACK_REASON_")
REJECT: Final = _labels(pb.RejectReason, "REJECT_REASON_")
TIER: Final = _labels(pb.Tier, "TIER_")
MESSAGE_KIND: Final = _labels(pb.MessageKind, "MESSAGE_KIND_")
REQUEST_KIND: Final = _labels(pb.RequestKind, "REQUEST_KIND_")
PRIORITY: Final = _labels(pb.PriorityClass, "PRIORITY_CLASS_")
STATUS_BY_LABEL: Final[dict[str, pb.Status.ValueType]] = {
    pb.Status.Name(value).removeprefix("STATUS_").lower(): value for value in pb.Status.values()
}
