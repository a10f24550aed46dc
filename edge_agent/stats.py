"""What the agent counts about the requests local services hand it (read by its metrics)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

FAIL_FAST_REASONS: Final = {
    "round_trip": "realtime deadline shorter than the round trip to HK",
    "local_busy": "deadline passed before the local model was free",
}
"""Why a request was answered DEADLINE_EXCEEDED without being tried: metric label -> caller's message."""


@dataclass
class AgentStats:
    """Requests taken at the intake and what became of them; every labelled count is per reason."""

    received: int = 0
    local: int = 0
    remote: int = 0
    failed_fast: Counter[str] = field(default_factory=lambda: Counter(dict.fromkeys(FAIL_FAST_REASONS, 0)))
    refused: int = 0  # nacked at intake: spool full or in-flight window full
    orphan_responses: int = 0  # answers for callers that left (e.g. recovered from the spool)
    orphan_acks: int = 0  # Acks a local caller was not reading (its socket full)
    responses: Counter[str] = field(default_factory=Counter)  # answers given to callers, by status
    bad_frames: Counter[str] = field(default_factory=Counter)  # intake frames not taken, by reject label
