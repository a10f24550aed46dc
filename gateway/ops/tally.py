"""The hot path's counts and observations as plain numbers, added to their Prometheus series at collection.

A prometheus_client child's ``inc`` or ``observe`` is four Python calls (label lookup, two observability
checks, the value's locked add), ~1 us; a lone realtime request made ~17 of them, about a sixth of its
Python calls. :class:`Tally` keeps what the frame path counts in two dicts, keyed by metric and label
values, under one lock, and adds it to the metrics' children when the registry is collected: it registers
first, so every scrape (``GatewayMetrics.render``, a shard's metrics over the link, ``get_sample_value``)
sees every count made before it began, as if each had been added at once (collections on two threads at
the same time take turns). A registry restricted to some names (``restricted_registry``, ``name[]`` in a
scrape's query) does not ask the tally: the gateway renders its whole registry.

Only counters and histograms, whose values are sums; gauges are set where they change. The label values
are the caller's, bounded as for ``metric.labels`` (gateway/ops/metrics.py). The lock: the gateway's loop
adds, and its HTTP thread collects.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from math import isnan
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric

from gateway.ops.histograms import add_observations

CountKey = tuple[Counter, tuple[str, ...]]
HistogramKey = tuple[Histogram, tuple[str, ...]]


class Tally:
    """Counter increments and histogram observations held until the next collection."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        """``registry``: collecting it flushes the tally; register the tally before the metrics it holds
        counts of, so that they are read after it."""
        self._lock = threading.Lock()  # the held counts: adds and the swap at a flush
        self._flushing = threading.Lock()  # one flush at a time: a second collection waits for the first
        self._counts: dict[CountKey, float] = {}
        # per histogram and labels: [sum of the values, then a count per bucket (the last one +Inf)]
        self._observed: dict[HistogramKey, list[float]] = {}
        self._bounds: dict[Histogram, list[float]] = {}
        if registry is not None:
            registry.register(self)

    def inc(self, metric: Counter, labels: tuple[str, ...], amount: float = 1.0) -> None:
        """What ``metric.labels(*labels).inc(amount)`` adds (``labels`` empty: the metric itself)."""
        key = (metric, labels)
        with self._lock:
            counts = self._counts
            counts[key] = counts.get(key, 0.0) + amount

    def observe(self, metric: Histogram, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        """What ``count`` calls of ``metric.labels(*labels).observe(value)`` add."""
        bounds = self._bounds.get(metric)
        if bounds is None:
            bounds = self._bounds[metric] = bucket_bounds(metric)
        # NaN: in no bucket, and into the sum, as Histogram.observe does
        bucket = 1 + min(bisect_left(bounds, value), len(bounds) - 1) if not isnan(value) else 0
        key = (metric, labels)
        with self._lock:
            entry = self._observed.get(key)
            if entry is None:
                entry = self._observed[key] = [0.0] * (len(bounds) + 1)
            entry[0] += value * count
            if bucket:
                entry[bucket] += count

    def flush(self) -> None:
        """Add everything held to the metrics' children, and hold nothing. An entry that cannot be added
        (labels that do not fit its metric: a bug at the call) does not keep the others from being added;
        the first such error is raised once they are."""
        with self._flushing:
            with self._lock:
                counts, self._counts = self._counts, {}
                observed, self._observed = self._observed, {}
            failed: Exception | None = None
            for (counter, labels), amount in counts.items():
                try:
                    _child(counter, labels).inc(amount)
                except (ValueError, TypeError) as exc:
                    failed = failed or exc
            for (histogram, labels), entry in observed.items():
                try:
                    add_observations(_child(histogram, labels), entry[0], entry[1:])
                except (ValueError, TypeError) as exc:
                    failed = failed or exc
        if failed is not None:
            raise failed

    # A collector of the registry, registered before any metric: collecting it flushes, and it has no
    # series of its own.
    def collect(self) -> Iterator[Metric]:
        self.flush()
        return iter(())

    def describe(self) -> Iterable[Metric]:
        return ()


def bucket_bounds(histogram: Histogram) -> list[float]:
    """A histogram's bucket upper bounds, the last one +Inf, as prometheus_client keeps them."""
    bounds: Any = getattr(histogram, "_upper_bounds", None)
    if not bounds or bounds[-1] != float("inf"):
        raise TypeError("this prometheus_client keeps no bucket bounds on its histograms")
    return list(bounds)


def _child(metric: Any, labels: tuple[str, ...]) -> Any:
    return metric.labels(*labels) if labels else metric
