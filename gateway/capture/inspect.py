"""``hk-gateway capture inspect``: what a set of capture files holds, without replaying it."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgewire import FrameError, labels, pb
from gateway.capture.format import Corrupt, read_capture, read_header, reader_codec

_KIND = {
    pb.REQUEST_KIND_RANKING: "ranking",
    pb.REQUEST_KIND_TEXT: "text",
    pb.REQUEST_KIND_IMAGE: "image",
    pb.REQUEST_KIND_TENSOR: "tensor",
}


@dataclass(slots=True)
class CaptureStats:
    """Counts over capture files: messages by kind/region/carrier, requests by kind/model, time span."""

    files: int = 0
    redacted_files: int = 0
    messages: int = 0
    corrupt: list[str] = field(default_factory=list)  # "<file>: <reason>" for each unreadable stretch
    undecodable: int = 0  # messages whose frames never decoded (also refused by the gateway)
    messages_by_kind: Counter[str] = field(default_factory=Counter)
    messages_by_region: Counter[str] = field(default_factory=Counter)
    messages_by_carrier: Counter[str] = field(default_factory=Counter)
    requests_by_kind: Counter[str] = field(default_factory=Counter)
    requests_by_model: Counter[str] = field(default_factory=Counter)
    first_unix_us: int = 0
    last_unix_us: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "redacted_files": self.redacted_files,
            "messages": self.messages,
            "corrupt": self.corrupt,
            "undecodable": self.undecodable,
            "messages_by_kind": dict(self.messages_by_kind),
            "messages_by_region": dict(self.messages_by_region),
            "messages_by_carrier": dict(self.messages_by_carrier),
            "requests": sum(self.requests_by_kind.values()),
            "requests_by_kind": dict(self.requests_by_kind),
            "requests_by_model": dict(self.requests_by_model),
            "first_unix_us": self.first_unix_us,
            "last_unix_us": self.last_unix_us,
            "span_s": (self.last_unix_us - self.first_unix_us) / 1e6 if self.messages else 0.0,
        }


def inspect(paths: Sequence[Path]) -> CaptureStats:
    """Read every record of every file (never raising on bad content)."""
    stats = CaptureStats()
    for path in paths:
        stats.files += 1
        header = read_header(path)
        stats.redacted_files += int(header is not None and header.redacted)
        codec = reader_codec(header)
        for entry in read_capture(path):
            if isinstance(entry, Corrupt):
                stats.corrupt.append(f"{path}: offset {entry.offset}: {entry.reason}")
                continue
            stats.messages += 1
            t = entry.arrival_unix_us
            stats.first_unix_us = t if not stats.first_unix_us else min(stats.first_unix_us, t)
            stats.last_unix_us = max(stats.last_unix_us, t)
            stats.messages_by_region[entry.region or "-"] += 1
            stats.messages_by_carrier[entry.carrier or "-"] += 1
            try:
                decoded = codec.decode(list(entry.frames))
            except (FrameError, ValueError):
                stats.undecodable += 1
                stats.messages_by_kind["undecodable"] += 1
                continue
            stats.messages_by_kind[labels.MESSAGE_KIND.get(decoded.envelope.kind, "other")] += 1
            if isinstance(decoded.payload, pb.RequestBatch):
                for request in decoded.payload.requests:
                    stats.requests_by_kind[_KIND.get(request.kind, "other")] += 1
                    stats.requests_by_model[request.model_name or "-"] += 1
    return stats


def render(stats: CaptureStats, as_json: bool) -> str:
    """The report: JSON, or aligned text for a terminal."""
    data = stats.as_dict()
    if as_json:
        return json.dumps(data, sort_keys=True)
    lines = [
        f"{data['files']} file(s) ({data['redacted_files']} redacted), {data['messages']} messages, "
        f"{data['requests']} requests over {data['span_s']:.1f} s",
    ]
    for key in ("messages_by_kind", "messages_by_region", "messages_by_carrier", "requests_by_kind",
                "requests_by_model"):  # fmt: skip
        counts = ", ".join(f"{k} {v}" for k, v in sorted(data[key].items())) or "-"
        lines.append(f"  {key.replace('_', ' ')}: {counts}")
    lines.append(f"  undecodable messages: {data['undecodable']}")
    lines.append(f"  corrupt: {len(data['corrupt'])}")
    lines.extend(f"    {c}" for c in data["corrupt"])
    return "\n".join(lines)
