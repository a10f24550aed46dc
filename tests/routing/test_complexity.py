"""Complexity estimators: per-kind scores, the client hint, calibration and the latency map."""

from __future__ import annotations

import math

import pytest

from routing import LatencyCalibrator, RequestKind, RequestProfile
from routing.complexity import (
    ComplexityEstimator,
    apply_hint,
    image_score,
    ranking_score,
    tensor_score,
    text_score,
)
from routing.config import CalibrationConfig, CostModelConfig, WorkScale

COST = CostModelConfig()
SCALE = WorkScale(floor=16, ceiling=4096)


def test_score_is_zero_at_or_below_floor() -> None:
    """Work at or below the floor scores 0."""
    assert text_score(16, SCALE) == 0.0 and text_score(0, SCALE) == 0.0


def test_score_is_one_at_or_above_ceiling() -> None:
    """Work at or above the ceiling scores 1."""
    assert text_score(4096, SCALE) == 1.0 and text_score(10**9, SCALE) == 1.0


def test_score_is_log_linear_between() -> None:
    """Each doubling of work moves the score by the same step (log-linear map)."""
    assert text_score(256, SCALE) == pytest.approx(0.5)
    assert text_score(64, SCALE) - text_score(32, SCALE) == pytest.approx(1 / 8)


def test_ranking_work_is_candidates_times_width() -> None:
    """Ranking work is candidates x feature width, and width 0 counts as 1."""
    assert ranking_score(16, 16, SCALE) == text_score(256, SCALE)
    assert ranking_score(256, 0, SCALE) == text_score(256, SCALE)


def test_image_and_tensor_scores_use_their_counts() -> None:
    """Image work is pixels; tensor work is elements."""
    assert image_score(256, SCALE) == tensor_score(256, SCALE) == pytest.approx(0.5)


def test_hint_raises_score() -> None:
    """A hint above the estimate replaces it."""
    assert apply_hint(0.2, 0.6) == 0.6


def test_hint_never_lowers_score() -> None:
    """A hint below the estimate is ignored."""
    assert apply_hint(0.6, 0.2) == 0.6


@pytest.mark.parametrize("hint", [math.nan, -1.0, 0.0], ids=["nan", "negative", "zero"])
def test_meaningless_hint_is_ignored(hint: float) -> None:
    """NaN, negative and zero hints leave the score alone."""
    assert apply_hint(0.4, hint) == 0.4


def test_hint_above_one_is_clamped() -> None:
    """A hint above 1 raises the score to 1, not beyond."""
    assert apply_hint(0.4, 7.0) == 1.0


def test_text_tokens_estimated_from_chars() -> None:
    """Without a token count, text work is characters / chars_per_token."""
    estimator = ComplexityEstimator(COST)
    assert estimator.work(RequestProfile(RequestKind.TEXT, "m", text_chars=400)) == 100.0


def test_text_token_count_wins_over_chars() -> None:
    """An exact token count is used instead of the character estimate."""
    estimator = ComplexityEstimator(COST)
    assert estimator.work(RequestProfile(RequestKind.TEXT, "m", text_chars=400, text_tokens=7)) == 7.0


def test_cost_factor_scales_work() -> None:
    """A model's cost_factor multiplies its work before scoring."""
    estimator = ComplexityEstimator(COST)
    profile = RequestProfile(RequestKind.IMAGE, "m", pixels=50_000)
    assert estimator.score(profile, 4.0)[0] > estimator.score(profile, 1.0)[0]


def test_size_bucket_is_bit_length_of_work() -> None:
    """The size bucket is the power-of-two bucket of the work; zero work is bucket 0."""
    estimator = ComplexityEstimator(COST)
    assert estimator.size_bucket(RequestProfile(RequestKind.IMAGE, "m", pixels=1024)) == 11
    assert estimator.size_bucket(RequestProfile(RequestKind.IMAGE, "m")) == 0


def test_latency_map_round_trips() -> None:
    """score_for_latency inverts latency_for_score."""
    estimator = ComplexityEstimator(COST)
    assert estimator.score_for_latency(estimator.latency_for_score(0.42)) == pytest.approx(0.42)


def test_calibration_waits_for_min_samples() -> None:
    """Observations change the score only once the bucket has min_samples of them."""
    calibrator = LatencyCalibrator()
    estimator = ComplexityEstimator(COST, CalibrationConfig(min_samples=3), calibrator)
    profile = RequestProfile(RequestKind.IMAGE, "m", pixels=50_000)
    static, bucket = estimator.score(profile)
    calibrator.observe("m", bucket, 0.4)
    calibrator.observe("m", bucket, 0.4)
    assert estimator.score(profile)[0] == static
    calibrator.observe("m", bucket, 0.4)
    assert estimator.score(profile)[0] == pytest.approx(estimator.score_for_latency(0.4))


def test_calibration_weight_blends() -> None:
    """With weight w the score is static + w x (calibrated - static)."""
    calibrator = LatencyCalibrator()
    estimator = ComplexityEstimator(COST, CalibrationConfig(min_samples=1, weight=0.5), calibrator)
    profile = RequestProfile(RequestKind.IMAGE, "m", pixels=50_000)
    static, bucket = estimator.score(profile)
    calibrator.observe("m", bucket, 0.5)
    assert estimator.score(profile)[0] == pytest.approx((static + 1.0) / 2)


def test_calibration_can_be_disabled() -> None:
    """With calibration disabled observations have no effect."""
    calibrator = LatencyCalibrator()
    estimator = ComplexityEstimator(COST, CalibrationConfig(enabled=False, min_samples=1), calibrator)
    profile = RequestProfile(RequestKind.IMAGE, "m", pixels=50_000)
    static, bucket = estimator.score(profile)
    calibrator.observe("m", bucket, 0.5)
    assert estimator.score(profile)[0] == static


def test_service_time_uses_slower_calibrated_latency() -> None:
    """A calibrated latency above the cost model's ceiling is not cut down to it."""
    calibrator = LatencyCalibrator()
    estimator = ComplexityEstimator(COST, CalibrationConfig(min_samples=1), calibrator)
    profile = RequestProfile(RequestKind.IMAGE, "m", pixels=50_000)
    score, bucket = estimator.score(profile)
    calibrator.observe("m", bucket, 5.0)
    score, bucket = estimator.score(profile)
    assert estimator.service_time(profile, score, bucket) == 5.0
