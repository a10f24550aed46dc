"""The Tally: counts and observations held, then added at collection exactly as direct calls add them."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.ops.histograms import add_observations
from gateway.ops.metrics import GatewayMetrics
from gateway.ops.tally import Tally

BUCKETS = (0.001, 0.01, 0.1, 1.0)


def _pair() -> tuple[CollectorRegistry, Counter, Histogram, CollectorRegistry, Counter, Histogram, Tally]:
    """The same metrics twice: one set fed directly, the other through a Tally registered first (as
    GatewayMetrics registers its own)."""
    direct = CollectorRegistry()
    held = CollectorRegistry()
    tally = Tally(registry=held)
    return (
        direct,
        Counter("c", "c", ["pool", "kind"], registry=direct),
        Histogram("h", "h", ["pool"], buckets=BUCKETS, registry=direct),
        held,
        Counter("c", "c", ["pool", "kind"], registry=held),
        Histogram("h", "h", ["pool"], buckets=BUCKETS, registry=held),
        tally,
    )


values = st.floats(min_value=0.0, max_value=20.0, allow_nan=False) | st.sampled_from([0.0, *BUCKETS])
# What the gateway counts: whole numbers (frames, bytes, requests) on counters, any value on histograms.
events = st.lists(
    st.tuples(st.just("inc"), st.sampled_from(["cpu", "gpu"]), st.integers(0, 10**6).map(float), st.just(1))
    | st.tuples(st.just("observe"), st.sampled_from(["cpu", "gpu"]), values, st.integers(1, 5)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(events=events, collect_at=st.integers(0, 40))
def test_collection_shows_what_direct_calls_add(
    events: list[tuple[str, str, float, int]], collect_at: int
) -> None:
    """Whatever the sequence, and wherever a collection falls within it, every collection reads what the
    same calls made directly on the children read (counts exact, sums to rounding)."""
    direct, counter, histogram, held, held_counter, held_histogram, tally = _pair()
    for i, (kind, pool, value, n) in enumerate(events):
        if i == collect_at:
            assert _values(held) == pytest.approx(_values(direct))
        if kind == "inc":
            counter.labels(pool, "x").inc(value)
            tally.inc(held_counter, (pool, "x"), value)
        else:
            for _ in range(n):
                histogram.labels(pool).observe(value)
            tally.observe(held_histogram, (pool,), value, n)
    got, want = _values(held), _values(direct)
    assert got == pytest.approx(want)
    assert {k: v for k, v in got.items() if not k[0].endswith("_sum")} == {
        k: v for k, v in want.items() if not k[0].endswith("_sum")
    }  # counts and buckets exactly; sums differ in rounding only (n * value against n additions)


def _values(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def test_nothing_is_added_before_a_collection_and_nothing_twice() -> None:
    registry = CollectorRegistry()
    tally = Tally(registry=registry)
    counter = Counter("c", "c", ["pool"], registry=registry)
    tally.inc(counter, ("cpu",), 3)
    assert counter.labels("cpu")._value.get() == 0  # held, not added yet
    assert registry.get_sample_value("c_total", {"pool": "cpu"}) == 3
    assert registry.get_sample_value("c_total", {"pool": "cpu"}) == 3  # a second collection adds nothing
    tally.inc(counter, ("cpu",))
    assert registry.get_sample_value("c_total", {"pool": "cpu"}) == 4


def test_a_metric_without_labels_is_counted_on_itself() -> None:
    registry = CollectorRegistry()
    tally = Tally(registry=registry)
    counter = Counter("plain", "p", registry=registry)
    histogram = Histogram("lat", "l", buckets=BUCKETS, registry=registry)
    tally.inc(counter, (), 2)
    tally.observe(histogram, (), 0.05, 3)
    assert registry.get_sample_value("plain_total") == 2
    assert registry.get_sample_value("lat_count") == 3
    assert registry.get_sample_value("lat_bucket", {"le": "0.01"}) == 0
    assert registry.get_sample_value("lat_bucket", {"le": "0.1"}) == 3
    assert registry.get_sample_value("lat_sum") == pytest.approx(0.15)


def test_counts_from_the_loop_survive_collections_on_another_thread() -> None:
    """The gateway's loop adds while its HTTP thread collects: no count is lost or added twice."""
    registry = CollectorRegistry()
    tally = Tally(registry=registry)
    counter = Counter("c", "c", ["pool"], registry=registry)
    histogram = Histogram("h", "h", buckets=BUCKETS, registry=registry)
    per_thread, threads = 20_000, 2
    stop = threading.Event()

    def add() -> None:
        for _ in range(per_thread):
            tally.inc(counter, ("cpu",))
            tally.observe(histogram, (), 0.005)

    def collect() -> None:
        while not stop.is_set():
            registry.get_sample_value("c_total", {"pool": "cpu"})

    collector = threading.Thread(target=collect)
    collector.start()
    adders = [threading.Thread(target=add) for _ in range(threads)]
    for thread in adders:
        thread.start()
    for thread in adders:
        thread.join()
    stop.set()
    collector.join()
    assert registry.get_sample_value("c_total", {"pool": "cpu"}) == per_thread * threads
    assert registry.get_sample_value("h_count") == per_thread * threads
    assert registry.get_sample_value("h_bucket", {"le": "0.01"}) == per_thread * threads


def test_the_gateway_registry_flushes_before_its_metrics_are_read() -> None:
    metrics = GatewayMetrics(["ranker"])
    metrics.tally.inc(metrics.frames_received, ("hgc", "request_batch"), 2)
    metrics.tally.observe(metrics.latency, ("cloud", "cpu"), 0.02, 4)
    text = metrics.render().decode()
    assert 'hkgw_frames_received_total{carrier="hgc",kind="request_batch"} 2.0' in text
    assert 'hkgw_request_latency_seconds_count{pool="cpu",tier="cloud"} 4.0' in text


def test_bucket_counts_must_match_the_histogram() -> None:
    histogram = Histogram("h", "h", buckets=BUCKETS, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="bucket counts"):
        add_observations(histogram, 1.0, [1.0, 0.0])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.001])
def test_an_odd_value_lands_where_observe_puts_it(value: float) -> None:
    """NaN in no bucket (the count does not move) and into the sum; +Inf in the last bucket; a negative
    value in the first; a value on a bound in that bound's bucket: as Histogram.observe does."""
    direct, _, histogram, held, _, held_histogram, tally = _pair()
    histogram.labels("cpu").observe(value)
    histogram.labels("cpu").observe(value)
    tally.observe(held_histogram, ("cpu",), value, 2)
    got, want = _values(held), _values(direct)
    assert got.keys() == want.keys()
    for key, expected in want.items():
        assert got[key] == pytest.approx(expected, nan_ok=True), key


def test_an_entry_that_cannot_be_added_keeps_no_other_from_being_added() -> None:
    registry = CollectorRegistry()
    tally = Tally(registry=registry)
    counter = Counter("c", "c", ["pool"], registry=registry)
    tally.inc(counter, ("cpu", "one label too many"))
    tally.inc(counter, ("gpu",), 5)
    with pytest.raises(ValueError, match="label"):
        tally.flush()
    assert registry.get_sample_value("c_total", {"pool": "gpu"}) == 5  # added; the bad entry is gone
