"""Many observations of a histogram at the cost of one.

The frame path answers a frame's requests per group, and the requests of a group share their latency (one
frame, one batch): ``observe_many(h, latency, n)`` adds what ``n`` calls of ``h.observe(latency)`` add.
:func:`add_observations` adds a sum and per-bucket counts gathered elsewhere (gateway/ops/tally.py).

prometheus_client keeps a child's buckets as per-bucket counts over ``_upper_bounds`` (the last one +Inf)
and its sum in ``_sum``, in every value mode (multiprocess files included); ``observe`` adds 1 to the first
bucket whose bound is >= the amount, and the amount to the sum.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from prometheus_client import Histogram


def observe_many(histogram: Histogram, amount: float, count: int) -> None:
    """``count`` observations of ``amount`` on a histogram child (one with its labels applied): ``count``
    added to the bucket of ``amount`` and ``amount * count`` to the sum. A client without those fields gets
    ``count`` calls of ``observe``."""
    if count <= 0:
        return
    child: Any = histogram
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if count == 1 or bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    if not math.isnan(amount):  # NaN: in no bucket, as observe() does
        buckets[min(bisect_left(bounds, amount), len(buckets) - 1)].inc(count)


def add_observations(histogram: Histogram, total: float, counts: Sequence[float]) -> None:
    """Observations whose values sum to ``total``, ``counts[i]`` of them in bucket ``i``, added to a
    histogram child at once."""
    child: Any = histogram
    buckets = child._buckets
    if len(counts) != len(buckets):
        raise ValueError(f"{len(counts)} bucket counts for a histogram of {len(buckets)} buckets")
    child._sum.inc(total)
    for bucket, count in zip(buckets, counts, strict=True):
        if count:
            bucket.inc(count)
