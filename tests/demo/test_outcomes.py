"""The demo's explanations of answers that were not OK: every message the agent writes itself is in the
table, one cause is one line whatever its numbers, and a message not in the table is flagged."""

from __future__ import annotations

from collections import Counter

from demo.outcomes import explain, explain_all, grouped, shape, unexplained
from edge_agent.drive import NO_ANSWER
from edge_agent.stats import FAIL_FAST_REASONS


def test_the_agents_own_messages_are_explained() -> None:
    """The client's no-answer message and each fail-fast reason the agent answers with have a meaning."""
    messages = [NO_ANSWER, *FAIL_FAST_REASONS.values()]
    assert [m for m in messages if explain("DEADLINE_EXCEEDED", m) is None] == []


def test_numbers_do_not_split_one_cause() -> None:
    """Two gateway expiries that differ only in their numbers are one line; digits in names stay."""
    not_ok = Counter(
        {
            ("DEADLINE_EXCEEDED", "expired 89.1 ms ago"): 2,
            ("DEADLINE_EXCEEDED", "expired 3.0 ms ago"): 1,
            ("OVERLOADED", "pool gpu-a100 queue full"): 1,
        }
    )
    assert grouped(not_ok) == Counter(
        {("DEADLINE_EXCEEDED", "expired N ms ago"): 3, ("OVERLOADED", "pool gpu-a100 queue full"): 1}
    )
    assert shape("model rank-mlp: deadline of -0.17s passed before the call ran") == (
        "model rank-mlp: deadline of Ns passed before the call ran"
    )
    assert unexplained(not_ok) == []


def test_an_unknown_message_is_flagged() -> None:
    """A message not in the table gets its status's general meaning and is listed as unexplained."""
    not_ok = Counter({("INTERNAL", "something new broke"): 4})
    assert unexplained(not_ok) == [("INTERNAL", "something new broke")]
    (line,) = explain_all(not_ok)
    assert "NOT IN demo/outcomes.py" in line
    assert line.lstrip().startswith("4 INTERNAL")
