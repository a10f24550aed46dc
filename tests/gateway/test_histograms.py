"""observe_many adds exactly what as many observe() calls add (buckets, count, sum)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.ops.histograms import observe_many

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value for metric in histogram.collect() for s in metric.samples
    }


@pytest.mark.parametrize("amount", [0.0, 0.001, 0.0011, 0.05, 1.0, 7.5])
@pytest.mark.parametrize("count", [1, 2, 37])
def test_observe_many_equals_repeated_observe(amount: float, count: int) -> None:
    one = Histogram("h", "h", ["pool"], buckets=BUCKETS, registry=CollectorRegistry())
    many = Histogram("h", "h", ["pool"], buckets=BUCKETS, registry=CollectorRegistry())
    for _ in range(count):
        one.labels("cpu").observe(amount)
    observe_many(many.labels("cpu"), amount, count)
    assert _samples(many) == pytest.approx(_samples(one))


def test_no_observation_adds_nothing() -> None:
    histogram = Histogram("h", "h", buckets=BUCKETS, registry=CollectorRegistry())
    observe_many(histogram, 0.5, 0)
    assert _samples(histogram)[("h_count", "")] == 0
