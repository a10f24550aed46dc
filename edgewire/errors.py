"""Typed codec failures: every rejection carries a reason that becomes a metric label and a log field."""

from __future__ import annotations

from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb

_PREFIX = "REJECT_REASON_"


def _label_of(reason: pb.RejectReason.ValueType) -> str:
    return pb.RejectReason.Name(reason).removeprefix(_PREFIX).lower()


_LABELS: dict[int, str] = {v: _label_of(v) for v in pb.RejectReason.values()}
"""Every reason's label, made once: a refused frame is counted, logged and answered by its label, and a
flood of refused frames asks for it tens of thousands of times a second (protobuf's enum Name() is a
Python call of its own)."""


def reject_label(reason: pb.RejectReason.ValueType) -> str:
    """The bounded, lower-case metric label of a reject reason, e.g. ``frame_too_large``."""
    label = _LABELS.get(reason)
    return _label_of(reason) if label is None else label  # a value this schema lacks: Name() raises


REJECT_LABELS: tuple[str, ...] = tuple(
    reject_label(v) for v in pb.RejectReason.values() if v != pb.REJECT_REASON_UNSPECIFIED
)


class FrameError(Exception):
    """A frame refused by the codec. ``reason`` is the wire enum, ``label`` its metric label."""

    def __init__(self, reason: pb.RejectReason.ValueType, detail: str) -> None:
        super().__init__(f"{reject_label(reason)}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def label(self) -> str:
        return reject_label(self.reason)
