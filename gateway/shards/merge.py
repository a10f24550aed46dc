"""One Prometheus exposition for the whole gateway from the front's and every shard's. Pure.

Series keep their names and labels (no shard label: a shard is not something an operator alerts on, and
N shards would multiply every series). How a series from several processes becomes one:

- counters, histograms and summaries add up; so do the gauges that count things (queue depth, batches in
  flight, dedupe entries, busy workers, pending replies);
- :data:`FRONT_OWNED` families describe the front's carriers and health: only the front's values count;
- :data:`WORST` gauges take the worst shard's value (a breaker open in any shard shows as open);
  :data:`LEAST` the lowest (a pool is healthy when it is in every shard); :data:`ANY` the highest.

A shard that restarts starts its counters from zero. So that the merged counters never go backwards,
:class:`Retired` keeps the last values read from each shard incarnation that ended and adds them in:
increments a dead shard made after the last scrape that reached it are the only ones lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

FRONT_OWNED = frozenset(
    {
        "hkgw_ready",
        "hkgw_draining",
        "hkgw_carrier_up",
        "hkgw_carrier_peers",
        "hkgw_reloads",
        "hkgw_shards",
        "hkgw_shards_serving",
    }
)
WORST = frozenset({"hkgw_breaker_state"})
LEAST = frozenset({"hkgw_pool_healthy"})
ANY = frozenset({"hkgw_capture_active"})
SUMMED_GAUGES = frozenset(
    {
        "hkgw_queue_depth",
        "hkgw_inflight_batches",
        "hkgw_dedupe_entries",
        "hkgw_cpu_workers_busy",
        "hkgw_pending_replies",
        "hkgw_inflate_pending",
        "hkgw_ingest_backlog_frames",
        "hkgw_held_connections",
    }
)
"""Every gauge the gateway exports is in exactly one of these sets (tests/gateway/shards checks it)."""
MONOTONIC = frozenset({"counter", "histogram", "summary"})

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def _combiner(name: str) -> Callable[[float, float], float]:
    if name in WORST or name in ANY:
        return max
    if name in LEAST:
        return min
    return float.__add__


class Retired:
    """Counter values of shard incarnations that ended, added to every later exposition. Bounded by the
    gateway's own label sets (the same series the shards export)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[SampleKey, float]] = {}

    def copy(self) -> Retired:
        out = Retired()
        out.values = {name: dict(samples) for name, samples in self.values.items()}
        return out

    def add(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            if family.type not in MONOTONIC:
                continue
            acc = self.values.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                acc[key] = acc.get(key, 0.0) + s.value


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge(front: str, shards: Sequence[str], retired: Retired | None = None) -> bytes:
    """The exposition of the front's text and the shards' (in the text format prometheus_client writes)."""
    kinds: dict[str, tuple[str, str]] = {}  # name -> (documentation, type)
    values: dict[str, dict[SampleKey, float]] = {}
    for text, from_front in ((front, True), *((s, False) for s in shards)):
        for family in text_string_to_metric_families(text):
            if not from_front and family.name in FRONT_OWNED:
                continue
            kinds.setdefault(family.name, (family.documentation, family.type))
            acc = values.setdefault(family.name, {})
            combine = _combiner(family.name)
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                acc[key] = combine(acc[key], s.value) if key in acc else s.value
    for name, old in (retired.values if retired is not None else {}).items():
        if name not in values:
            continue  # a family no live process exports any more is not resurrected
        acc = values[name]
        for key, value in old.items():
            acc[key] = acc.get(key, 0.0) + value
    families = []
    for name, (documentation, typ) in kinds.items():
        metric = Metric(name, documentation, typ)
        for (sample, labels), value in values[name].items():
            metric.add_sample(sample, dict(labels), value)
        families.append(metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
