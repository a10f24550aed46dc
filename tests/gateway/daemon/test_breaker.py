"""The circuit breaker's state machine."""

from __future__ import annotations

from gateway.dispatch.breaker import BreakerState, CircuitBreaker


def test_opens_after_threshold_and_closes_after_a_good_trial() -> None:
    """Consecutive failures open it; after open_s one trial is allowed and a success closes it."""
    breaker = CircuitBreaker(failure_threshold=2, open_s=5)
    breaker.failure(0)
    assert breaker.allow(0)
    breaker.failure(1)
    assert not breaker.allow(2)
    assert breaker.allow(6)
    assert not breaker.allow(6)
    breaker.success()
    assert breaker.state(7) is BreakerState.CLOSED


def test_trial_without_a_verdict_is_rearmed() -> None:
    """A trial call that ended with neither success nor failure does not leave the breaker stuck."""
    breaker = CircuitBreaker(failure_threshold=1, open_s=5)
    breaker.failure(0)
    assert breaker.allow(6)  # trial taken, then shed / cancelled: no verdict
    assert not breaker.allow(7)
    assert breaker.allow(12)


def test_failed_trial_reopens() -> None:
    """A failure in half-open opens it again for another open_s."""
    breaker = CircuitBreaker(failure_threshold=3, open_s=5)
    for t in range(3):
        breaker.failure(t)
    assert breaker.allow(8)
    breaker.failure(8)
    assert breaker.state(9) is BreakerState.OPEN
    assert not breaker.allow(12)


def test_success_says_whether_it_closed_the_breaker() -> None:
    """success() is True when it closes an open or half-open breaker, False when it was closed already."""
    breaker = CircuitBreaker(failure_threshold=2, open_s=5)
    assert breaker.success() is False
    breaker.failure(0)
    assert breaker.success() is False  # one failure under the threshold: it stayed closed
    breaker.failure(1)
    breaker.failure(2)
    assert breaker.success() is True  # open
    breaker.failure(3)
    breaker.failure(4)
    assert breaker.allow(10)  # half-open: a trial
    assert breaker.success() is True
    assert breaker.state(11) is BreakerState.CLOSED
