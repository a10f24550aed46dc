"""Per-backend circuit breaker: consecutive failures open it; a trial call after a cool-down may close it."""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    """Pure state machine over a clock the caller passes in (``now``, monotonic seconds)."""

    def __init__(self, failure_threshold: int, open_s: float, half_open_calls: int = 1) -> None:
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.half_open_calls = half_open_calls
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._trials = 0

    def state(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.open_s:
            self._state = BreakerState.HALF_OPEN
            self._trials = 0
            self._opened_at = now
        elif (
            self._state is BreakerState.HALF_OPEN
            and self._trials >= self.half_open_calls
            and now - self._opened_at >= self.open_s
        ):
            # The trial calls gave no verdict (shed, cancelled, refused inputs): allow new trials.
            self._trials = 0
            self._opened_at = now
        return self._state

    def allow(self, now: float) -> bool:
        """May a call go out now? In HALF_OPEN only ``half_open_calls`` trial calls are let through."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and self._trials < self.half_open_calls:
            self._trials += 1
            return True
        return False

    def success(self) -> bool:
        """A call succeeded: the breaker closes. True when it was not closed before (this closed it)."""
        opened = self._state is not BreakerState.CLOSED
        self._state = BreakerState.CLOSED
        self._failures = 0
        return opened

    def failure(self, now: float) -> None:
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._state = BreakerState.OPEN
            self._opened_at = now
