"""LatencyCalibrator: EWMA per (model, size bucket), fed by the caller."""

from __future__ import annotations

import math

import pytest

from routing import LatencyCalibrator, LatencyEstimate


def test_first_observation_is_the_estimate() -> None:
    """The first observation of a key becomes its estimate as is."""
    calibrator = LatencyCalibrator(alpha=0.5)
    calibrator.observe("m", 3, 0.2)
    assert calibrator.estimate("m", 3) == LatencyEstimate(0.2, 1)


def test_later_observations_are_smoothed() -> None:
    """Each later observation moves the estimate by alpha of the difference."""
    calibrator = LatencyCalibrator(alpha=0.5)
    calibrator.observe("m", 3, 0.2)
    calibrator.observe("m", 3, 0.4)
    estimate = calibrator.estimate("m", 3)
    assert estimate is not None
    assert estimate.latency_s == pytest.approx(0.3) and estimate.samples == 2


def test_keys_are_independent() -> None:
    """Models and buckets are calibrated separately."""
    calibrator = LatencyCalibrator()
    calibrator.observe("m", 3, 0.2)
    assert calibrator.estimate("m", 4) is None and calibrator.estimate("n", 3) is None


@pytest.mark.parametrize("latency", [-0.1, math.nan, math.inf], ids=["negative", "nan", "inf"])
def test_bad_latency_is_refused(latency: float) -> None:
    """Negative or non-finite latencies raise instead of poisoning the average."""
    with pytest.raises(ValueError, match="latency"):
        LatencyCalibrator().observe("m", 1, latency)


@pytest.mark.parametrize("alpha", [0.0, 1.5], ids=["zero", "above_one"])
def test_alpha_out_of_range_is_refused(alpha: float) -> None:
    """alpha must lie in (0, 1]."""
    with pytest.raises(ValueError, match="alpha"):
        LatencyCalibrator(alpha)


def test_snapshot_round_trips() -> None:
    """A calibrator restored from a snapshot holds the same estimates."""
    calibrator = LatencyCalibrator()
    calibrator.observe("m", 3, 0.2)
    calibrator.observe("n", 5, 0.1)
    restored = LatencyCalibrator.from_snapshot(calibrator.snapshot())
    assert restored.snapshot() == calibrator.snapshot() and len(restored) == 2
