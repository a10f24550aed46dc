"""What each answer that was not OK means for an operator: the demo's summary explains every one.

An answer is grouped by its status and ``error_message`` (who wrote that message and why is the
explanation), numbers in the message written as N (``expired N ms ago``), so one cause is one line;
messages with a variable part (a pool's or model's name, a spool drop reason) match by pattern. A
message not in the table still gets its status's general meaning and is marked unexplained, so a new
failure mode shows up in the summary instead of hiding in a total.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from edge_agent.drive import NO_ANSWER
from edge_agent.stats import FAIL_FAST_REASONS


@dataclass(frozen=True, slots=True)
class Explanation:
    """Where an answer came from and what an operator does about it."""

    source: str  # the component that wrote the answer
    meaning: str

    def render(self) -> str:
        return f"{self.source}: {self.meaning}"


_TABLE: Final[tuple[tuple[str, str, Explanation], ...]] = (
    (
        "DEADLINE_EXCEEDED",
        re.escape(NO_ANSWER),
        Explanation(
            "the client library (a LOST request)",
            "the agent gave no answer at all by the deadline plus 2 s; a bug or a dead agent: its log says "
            "which, and this count must be 0",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        re.escape(FAIL_FAST_REASONS["round_trip"]),
        Explanation(
            "the agent, without trying",
            "a realtime request whose budget cannot cover the round trip to Hong Kong plus its estimated "
            "service time, and no local model for it; many of them mean the carriers' RTT grew (edge_carrier_"
            "rtt_seconds) or callers set budgets shorter than the path allows",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        re.escape(FAIL_FAST_REASONS["local_busy"]),
        Explanation(
            "the agent's local tier",
            "the request waited for the local model past its deadline: the agent's CPU is too slow for "
            "the local share of traffic (more cores or [local] threads, or fewer requests on the edge tier)",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        "deadline passed before an answer from Hong Kong",
        Explanation(
            "the agent's uplink",
            "sent to Hong Kong, no answer before the deadline: the gateway queued it too long (pool queues, "
            "hkgw_pool_queue_depth) or the carriers lost it; see the gateway's latency and the agent's "
            "resent counts",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        "reject_deadline",
        Explanation(
            "the gateway's routing, without running it",
            "what was left of the budget when the request reached Hong Kong was less than any pool's "
            "estimated service time: time spent in the agent, on the carrier or in the gateway's intake "
            "ate the budget (tight realtime budgets on a busy host)",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        r"model .*: deadline (of Ns )?passed before the call ran",
        Explanation(
            "a Hong Kong pool, without running it",
            "the request waited in the gateway's pool queue (or CPU stage) until its deadline had passed "
            "before its batch reached the model: Hong Kong's pools are behind (hkgw_pool_queue_depth, "
            "the gateway's CPU); the N is how much time was left, negative when it had already run out",
        ),
    ),
    (
        "DEADLINE_EXCEEDED",
        "expired N ms ago",
        Explanation(
            "the gateway's intake",
            "the request's deadline had passed when it reached Hong Kong (by N ms): it waited in the agent "
            "(spool, send window, a resend) or on the carrier for its whole budget",
        ),
    ),
    (
        "OVERLOADED",
        "agent in-flight window full",
        Explanation(
            "the agent's intake, retryable",
            "more requests in flight to Hong Kong than uplink.max_inflight; the caller may retry after "
            "retry_after_ms; during an outage the spool's bound and this window decide how much is absorbed",
        ),
    ),
    (
        "OVERLOADED",
        r"spool full \(.*\)",
        Explanation(
            "the agent's spool, retryable",
            "the spool refused the write (full under its when_full policy, or the disk failed); "
            "edge_spool_bytes and the agent's log say which",
        ),
    ),
    (
        "OVERLOADED",
        r"spool fsync failed",
        Explanation("the agent's spool, retryable", "the disk failed to make the request durable; check it"),
    ),
    (
        "OVERLOADED",
        r"pool .* queue full|reject_overloaded",
        Explanation(
            "the gateway, retryable",
            "every pool that serves the model was at its queue limit (more load than Hong Kong's pools "
            "serve); the agent resends such nacks until the deadline, so seeing one means it ran out",
        ),
    ),
    (
        "INTERNAL",
        "local tier failed",
        Explanation(
            "the agent's local tier", "the local model call raised: the agent's log has the traceback"
        ),
    ),
    (
        "MODEL_NOT_FOUND",
        "no local model|reject_no_model",
        Explanation("routing", "no local model and no Hong Kong pool serves this model: a config mismatch"),
    ),
    (
        "INVALID_ARGUMENT",
        "request id already used.*",
        Explanation("the agent's intake", "the caller reused a request id; every request needs a new one"),
    ),
)
_PATTERNS: Final = tuple((status, re.compile(pattern), why) for status, pattern, why in _TABLE)

BY_STATUS: Final = {
    "DEADLINE_EXCEEDED": "the deadline passed before an answer",
    "OVERLOADED": "refused for load, retryable after retry_after_ms",
    "UNAVAILABLE": "refused while draining or with no healthy backend, retryable",
    "INVALID_ARGUMENT": "the request itself was refused (a bad input); the message names the field",
    "INTERNAL": "a model or backend failed for this request; the logs have the error",
    "MODEL_NOT_FOUND": "nothing serves this model",
}


_NUMBER: Final = re.compile(r"(?<![\w.-])-?\d+(?:\.\d+)?")
"""A number standing alone (``-0.17s``, ``89.1 ms``), not one inside a name (``gpu-a100``)."""


def shape(message: str) -> str:
    """``message`` with its numbers written as N: the grouping key of answers with one cause."""
    return _NUMBER.sub("N", message)


def grouped(not_ok: Counter[tuple[str, str]]) -> Counter[tuple[str, str]]:
    """(status, message shape) -> answers."""
    out: Counter[tuple[str, str]] = Counter()
    for (status, message), count in not_ok.items():
        out[(status, shape(message))] += count
    return out


def explain(status: str, message: str) -> Explanation | None:
    """The table's explanation of one (status, error_message), or None when it is not in the table."""
    text = shape(message)
    for known, pattern, why in _PATTERNS:
        if known == status and pattern.fullmatch(text):
            return why
    return None


def explain_all(not_ok: Counter[tuple[str, str]]) -> list[str]:
    """One line per (status, message shape), most frequent first, each with what it means."""
    lines = []
    for (status, message), count in grouped(not_ok).most_common():
        why = explain(status, message)
        text = (
            why.render()
            if why is not None
            else f"NOT IN demo/outcomes.py's table ({BY_STATUS.get(status, 'an unusual status')})"
        )
        lines.append(f"  {count:>5} {status} {message or '(no message)'!r}: {text}")
    return lines


def unexplained(not_ok: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (status, message shape) pairs the table does not explain."""
    shapes = dict.fromkeys((status, shape(message)) for status, message in not_ok)
    return [(status, text) for status, text in shapes if explain(status, text) is None]
