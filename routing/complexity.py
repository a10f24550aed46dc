"""Complexity score of a request in [0, 1], from the request alone plus calibration the caller fed in.

Each request kind has a work measure (ranking: candidates x feature width; text: tokens; image: pixels;
tensor: input elements). Work maps log-linearly onto [0, 1] between the kind's floor and ceiling, because
work spans orders of magnitude. The same cost model maps a score to a service time on a speed-1.0 pool
(log-linearly between ``latency_floor_s`` and ``latency_ceiling_s``) and back, which is how observed
latencies calibrate the score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from routing.calibration import LatencyCalibrator
from routing.config import CalibrationConfig, CostModelConfig, WorkScale
from routing.types import RequestKind, RequestProfile


@dataclass(frozen=True, slots=True)
class _LogScale:
    """Precomputed log-linear map from a positive quantity onto [0, 1]."""

    low: float
    high: float
    log_low: float
    inv_span: float

    @classmethod
    def between(cls, low: float, high: float) -> _LogScale:
        return cls(low, high, math.log(low), 1.0 / (math.log(high) - math.log(low)))

    def score(self, value: float) -> float:
        if value <= self.low:
            return 0.0
        if value >= self.high:
            return 1.0
        return (math.log(value) - self.log_low) * self.inv_span

    def value(self, score: float) -> float:
        return math.exp(self.log_low + score / self.inv_span)


def _scale(work: WorkScale) -> _LogScale:
    return _LogScale.between(work.floor, work.ceiling)


def ranking_score(candidates: int, feature_width: int, scale: WorkScale) -> float:
    """Score of a ranking request: work = candidates x feature width (width 0 counts as 1)."""
    return _scale(scale).score(float(candidates * max(feature_width, 1)))


def text_score(tokens: float, scale: WorkScale) -> float:
    """Score of a text request: work = tokens."""
    return _scale(scale).score(tokens)


def image_score(pixels: int, scale: WorkScale) -> float:
    """Score of an image request: work = pixels."""
    return _scale(scale).score(float(pixels))


def tensor_score(elements: int, scale: WorkScale) -> float:
    """Score of a generic tensor request: work = input elements."""
    return _scale(scale).score(float(elements))


def apply_hint(score: float, hint: float) -> float:
    """Raise ``score`` to the client's hint; a hint can never lower it, and NaN or <= 0 means no hint."""
    if hint > score:
        return min(hint, 1.0)
    return score


class ComplexityEstimator:
    """Scores requests under one cost model, optionally consulting a :class:`LatencyCalibrator`.

    Deterministic: the score depends only on the profile, the config and the calibrator's state.
    """

    __slots__ = (
        "_cal_min",
        "_cal_weight",
        "_calibrator",
        "_chars_per_token",
        "_latency",
        "_scales",
    )

    def __init__(
        self,
        cost: CostModelConfig,
        calibration: CalibrationConfig | None = None,
        calibrator: LatencyCalibrator | None = None,
    ) -> None:
        calibration = calibration or CalibrationConfig()
        self._scales: dict[RequestKind, _LogScale] = {
            RequestKind.RANKING: _scale(cost.ranking),
            RequestKind.TEXT: _scale(cost.text),
            RequestKind.IMAGE: _scale(cost.image),
            RequestKind.TENSOR: _scale(cost.tensor),
        }
        self._chars_per_token = cost.chars_per_token
        self._latency = _LogScale.between(cost.latency_floor_s, cost.latency_ceiling_s)
        self._calibrator = calibrator if calibration.enabled else None
        self._cal_min = calibration.min_samples
        self._cal_weight = calibration.weight

    def work(self, profile: RequestProfile) -> float:
        """Work units of the request under its kind's measure."""
        return self.work_of(
            profile.kind,
            profile.candidates,
            profile.feature_width,
            profile.text_chars,
            profile.text_tokens,
            profile.pixels,
            profile.tensor_elements,
        )

    def work_of(
        self,
        kind: RequestKind,
        candidates: int,
        width: int,
        chars: int,
        tokens: int,
        pixels: int,
        elements: int,
    ) -> float:
        """:meth:`work` from the size fields themselves (a frame's columns, with no profile built)."""
        if kind is RequestKind.RANKING:
            return float(candidates * max(width, 1))
        if kind is RequestKind.TEXT:
            if tokens > 0:
                return float(tokens)
            return chars / self._chars_per_token
        if kind is RequestKind.IMAGE:
            return float(pixels)
        return float(elements)

    def size_bucket(self, profile: RequestProfile) -> int:
        """Power-of-two bucket of the request's work: the calibration key beside the model name."""
        work = self.work(profile)
        return int(work).bit_length() if work > 0 else 0

    def score(self, profile: RequestProfile, cost_factor: float = 1.0) -> tuple[float, int]:
        """The request's score in [0, 1] and its size bucket.

        Static estimate, blended with the calibrated latency of (model, bucket) once it has enough samples,
        then raised to the client's hint.
        """
        work = self.work(profile)
        bucket = int(work).bit_length() if work > 0 else 0
        score = self._scales[profile.kind].score(work * cost_factor)
        if self._calibrator is not None:
            est = self._calibrator.estimate(profile.model, bucket)
            if est is not None and est.samples >= self._cal_min:
                calibrated = self._latency.score(est.latency_s)
                score += self._cal_weight * (calibrated - score)
        return apply_hint(score, profile.client_hint), bucket

    def service_time(self, profile: RequestProfile, score: float, bucket: int) -> float:
        """Expected service time of the request on a speed-1.0 pool, in seconds.

        The cost model's time for ``score``, or the calibrated time of (model, bucket) where that is larger
        (the log map stops at ``latency_ceiling_s``; a calibrated slow model must not look fast).
        """
        latency = self._latency.value(score)
        if self._calibrator is not None:
            est = self._calibrator.estimate(profile.model, bucket)
            if est is not None and est.samples >= self._cal_min and est.latency_s > latency:
                return est.latency_s
        return latency

    def latency_for_score(self, score: float) -> float:
        """Service time on a speed-1.0 pool of a request with this score."""
        return self._latency.value(score)

    def score_for_latency(self, latency_s: float) -> float:
        """Score of a request that takes ``latency_s`` on a speed-1.0 pool."""
        return self._latency.score(latency_s)
