"""Observed backend latency per (model, size bucket), smoothed with an EWMA.

The caller measures service times with its own clock and feeds them in; nothing here reads a clock. The
complexity estimator consults the calibrator so that the score follows what backends actually take rather
than only the static cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LatencyEstimate:
    """The smoothed latency of one (model, size bucket) and how many observations it rests on."""

    latency_s: float
    samples: int


class LatencyCalibrator:
    """EWMA of reference-speed service time per (model, size bucket).

    Latencies are stored as if served on a pool of speed 1.0; :meth:`TierPolicy.observe` scales a measured
    latency by the serving pool's speed before it calls :meth:`observe`. The state is a plain mapping, so
    a capture can :meth:`snapshot` it and a replay restore it to get the same decisions.
    """

    __slots__ = ("_state", "alpha")

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._state: dict[tuple[str, int], LatencyEstimate] = {}

    def observe(self, model: str, bucket: int, latency_s: float) -> None:
        """Fold one reference-speed service time into the (model, bucket) average."""
        if not math.isfinite(latency_s) or latency_s < 0.0:
            raise ValueError(f"latency must be a finite non-negative number of seconds, got {latency_s}")
        key = (model, bucket)
        prev = self._state.get(key)
        if prev is None:
            self._state[key] = LatencyEstimate(latency_s, 1)
        else:
            smoothed = prev.latency_s + self.alpha * (latency_s - prev.latency_s)
            self._state[key] = LatencyEstimate(smoothed, prev.samples + 1)

    def estimate(self, model: str, bucket: int) -> LatencyEstimate | None:
        """The current estimate for (model, bucket), or None before the first observation."""
        return self._state.get((model, bucket))

    def snapshot(self) -> dict[tuple[str, int], LatencyEstimate]:
        """A copy of the state, for capture and replay."""
        return dict(self._state)

    @classmethod
    def from_snapshot(
        cls, state: dict[tuple[str, int], LatencyEstimate], alpha: float = 0.2
    ) -> LatencyCalibrator:
        """A calibrator holding ``state`` (as returned by :meth:`snapshot`)."""
        calibrator = cls(alpha)
        calibrator._state = dict(state)
        return calibrator

    def __len__(self) -> int:
        return len(self._state)
