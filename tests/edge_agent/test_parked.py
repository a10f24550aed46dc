"""Parked answers: kept for a caller that is away, bounded by count and bytes, until their deadline."""

from __future__ import annotations

import pytest

from edge_agent.parked import ENTRY_BYTES, GRACE_S, UNKNOWN_DEADLINE_S, ParkedAnswers
from edgewire import pb

S = 1_000_000  # microseconds


class Clock:
    """Unix microseconds the test sets."""

    def __init__(self) -> None:
        self.now = 1_700_000_000 * S

    def __call__(self) -> int:
        return self.now


def answer(n: int, size: int = 0) -> pb.InferResponse:
    return pb.InferResponse(request_id=n.to_bytes(16, "big"), status=pb.STATUS_OK, error_message="x" * size)


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def test_an_answer_is_handed_to_its_caller_once() -> None:
    """A parked answer goes to the caller it was parked for, once; another caller cannot take it."""
    parked = ParkedAnswers(10, 1 << 20, clock=Clock())
    parked.park(b"svc-a", answer(1), 0)
    assert parked.claim(b"svc-b", rid(1)) is None
    got = parked.claim(b"svc-a", rid(1))
    assert got is not None and got.request_id == rid(1)
    assert parked.claim(b"svc-a", rid(1)) is None
    assert (parked.parked, parked.claimed, len(parked), parked.nbytes) == (1, 1, 0, 0)
    assert parked.dropped == {"expired": 0, "full": 0}


def test_answers_expire_at_their_deadline_plus_the_grace_and_are_counted() -> None:
    """Kept until the request's deadline plus GRACE_S, then dropped and counted as expired."""
    clock = Clock()
    parked = ParkedAnswers(10, 1 << 20, clock=clock)
    parked.park(b"svc", answer(1), clock.now + 1 * S)
    parked.park(b"svc", answer(2), clock.now + 5 * S)
    clock.now += 1 * S + int(GRACE_S * S) - 1
    assert parked.purge() == 0 and len(parked) == 2
    clock.now += 1
    assert parked.purge() == 1
    assert parked.claim(b"svc", rid(1)) is None
    assert parked.claim(b"svc", rid(2)) is not None
    assert parked.dropped == {"expired": 1, "full": 0}
    assert parked.next_expiry_us() is None


def test_an_expired_answer_is_dropped_by_a_claim_without_a_purge() -> None:
    """A claim after the expiry finds nothing even if no purge ran in between."""
    clock = Clock()
    parked = ParkedAnswers(10, 1 << 20, clock=clock)
    parked.park(b"svc", answer(1), clock.now + 1 * S)
    clock.now += 10 * S
    assert parked.claim(b"svc", rid(1)) is None
    assert parked.dropped["expired"] == 1


def test_an_answer_past_its_deadline_is_not_kept() -> None:
    """Parking an answer already past its deadline plus grace keeps nothing and counts it."""
    clock = Clock()
    parked = ParkedAnswers(10, 1 << 20, clock=clock)
    parked.park(b"svc", answer(1), clock.now - int(GRACE_S * S) - 1)
    assert len(parked) == 0 and parked.dropped["expired"] == 1


def test_without_a_known_deadline_an_answer_is_kept_for_a_while() -> None:
    """Deadline 0 (a local-tier answer): kept UNKNOWN_DEADLINE_S plus the grace, not forever."""
    clock = Clock()
    parked = ParkedAnswers(10, 1 << 20, clock=clock)
    parked.park(b"svc", answer(1), 0)
    assert parked.next_expiry_us() == clock.now + int((UNKNOWN_DEADLINE_S + GRACE_S) * S)


def test_the_count_bound_evicts_the_oldest_and_counts_it() -> None:
    """Over max_answers the oldest parked answer makes room, counted as full."""
    clock = Clock()
    parked = ParkedAnswers(3, 1 << 20, clock=clock)
    for n in range(5):
        parked.park(b"svc", answer(n), clock.now + 60 * S)
    assert len(parked) == 3
    assert [n for n in range(5) if rid(n) in parked] == [2, 3, 4]
    assert parked.dropped == {"expired": 0, "full": 2}


def test_the_byte_bound_evicts_the_oldest_and_counts_it() -> None:
    """Over max_bytes (serialized size plus ENTRY_BYTES each) the oldest answers make room."""
    clock = Clock()
    one = answer(0, 1000).ByteSize() + ENTRY_BYTES
    parked = ParkedAnswers(100, 3 * one, clock=clock)
    for n in range(4):
        parked.park(b"svc", answer(n, 1000), clock.now + 60 * S)
    assert [n for n in range(4) if rid(n) in parked] == [1, 2, 3]
    assert parked.nbytes == 3 * one <= parked.max_bytes
    assert parked.dropped == {"expired": 0, "full": 1}
    parked.park(b"svc", answer(9, 4 * one), clock.now + 60 * S)  # larger than the whole bound
    assert rid(9) not in parked and len(parked) == 3
    assert parked.dropped == {"expired": 0, "full": 2}


def test_bounds_must_be_positive() -> None:
    """A store that could hold nothing is a configuration error."""
    with pytest.raises(ValueError, match="positive"):
        ParkedAnswers(0, 1 << 20)
