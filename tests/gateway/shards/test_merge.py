"""The front's merge of its own and every shard's metrics (gateway/shards/merge.py), on the expositions of
real GatewayMetrics: counters and histograms add up, the front's own families come from the front alone,
gauges combine as their kind says, and a restarted shard does not make counters go backwards."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.ops.metrics import NS, GatewayMetrics
from gateway.shards.front import Front
from gateway.shards.merge import ANY, FRONT_OWNED, LEAST, MONOTONIC, SUMMED_GAUGES, WORST, Retired, merge
from gateway.testing import loopback_overrides

MODELS = ("rank-mlp", "text-encoder", "image-classifier")
GAUGE_SETS = {"FRONT_OWNED": FRONT_OWNED, "WORST": WORST, "LEAST": LEAST, "ANY": ANY, "SUMMED": SUMMED_GAUGES}

Key = tuple[str, frozenset[tuple[str, str]]]


def metrics() -> GatewayMetrics:
    return GatewayMetrics(models=MODELS)


def text(m: GatewayMetrics) -> str:
    return m.render().decode()


def samples(exposition: str | bytes) -> dict[Key, float]:
    if isinstance(exposition, bytes):
        exposition = exposition.decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }


def types(exposition: str | bytes) -> dict[str, str]:
    """Family name -> type."""
    if isinstance(exposition, bytes):
        exposition = exposition.decode()
    return {f.name: f.type for f in text_string_to_metric_families(exposition)}


def sample_types(exposition: str | bytes) -> dict[str, str]:
    """Sample name (``_total``, ``_bucket``, ...) -> its family's type."""
    if isinstance(exposition, bytes):
        exposition = exposition.decode()
    return {s.name: f.type for f in text_string_to_metric_families(exposition) for s in f.samples}


def value(merged: dict[Key, float], name: str, **labels: str) -> float | None:
    return merged.get((name, frozenset(labels.items())))


def test_counters_and_histograms_add_across_shards() -> None:
    front, one, two = metrics(), metrics(), metrics()
    one.accepted.labels("hgc").inc(3)
    two.accepted.labels("hgc").inc(4)
    two.accepted.labels("pccw").inc(1)
    one.duplicates.labels("pccw").inc(2)
    front.auth_rejected.labels("unknown_key").inc(2)  # counted in the front (ZAP), a sum like any other
    one.latency.labels("edge_server", "cpu").observe(0.003)
    two.latency.labels("edge_server", "cpu").observe(0.2)
    two.latency.labels("edge_server", "cpu").observe(0.2)
    one.batch_size.labels("cpu").observe(4)
    two.batch_size.labels("cpu").observe(64)
    merged = samples(merge(text(front), [text(one), text(two)]))
    assert value(merged, f"{NS}_requests_accepted_total", carrier="hgc") == 7
    assert value(merged, f"{NS}_requests_accepted_total", carrier="pccw") == 1
    assert value(merged, f"{NS}_requests_duplicate_total", carrier="pccw") == 2
    assert value(merged, f"{NS}_auth_rejected_total", reason="unknown_key") == 2
    latency = f"{NS}_request_latency_seconds"
    labels = {"tier": "edge_server", "pool": "cpu"}
    assert value(merged, f"{latency}_count", **labels) == 3
    assert value(merged, f"{latency}_sum", **labels) == pytest.approx(0.403)
    assert value(merged, f"{latency}_bucket", **labels, le="0.005") == 1
    assert value(merged, f"{latency}_bucket", **labels, le="0.25") == 3
    assert value(merged, f"{latency}_bucket", **labels, le="+Inf") == 3
    assert value(merged, f"{NS}_batch_size_bucket", pool="cpu", le="4.0") == 1
    assert value(merged, f"{NS}_batch_size_bucket", pool="cpu", le="64.0") == 2
    assert value(merged, f"{NS}_batch_size_count", pool="cpu") == 2
    # Series every process exports at zero stay one series, at zero.
    assert value(merged, f"{NS}_admin_refused_total", reason="missing") == 0


def test_front_owned_families_come_from_the_front_only() -> None:
    """Readiness, draining, carriers' health and peers, reloads and shards serving: the front's values,
    whatever the shards say (a shard's carriers are views of the link)."""
    front, one, two = metrics(), metrics(), metrics()
    front.ready.set(1)
    front.carrier_up.labels("hgc").set(0.5)
    front.carrier_peers.labels("hgc").set(3)
    front.reloads.labels("ok").inc()
    for shard in (one, two):
        shard.ready.set(0)
        shard.draining.set(1)
        shard.carrier_up.labels("hgc").set(1)
        shard.carrier_up.labels("tgt").set(1)  # the front has no series for it: none in the merge
        shard.carrier_peers.labels("hgc").set(7)
        shard.reloads.labels("ok").inc()
        shard.reloads.labels("failed").inc()
    merged = samples(merge(text(front), [text(one), text(two)]))
    assert value(merged, f"{NS}_ready") == 1
    assert value(merged, f"{NS}_draining") == 0
    assert value(merged, f"{NS}_carrier_up", carrier="hgc") == 0.5
    assert value(merged, f"{NS}_carrier_up", carrier="tgt") is None
    assert value(merged, f"{NS}_carrier_peers", carrier="hgc") == 3
    assert value(merged, f"{NS}_reloads_total", outcome="ok") == 1
    assert value(merged, f"{NS}_reloads_total", outcome="failed") is None


def test_gauges_combine_by_kind() -> None:
    """breaker_state: the worst shard's; pool_healthy: the least; capture_active: any; counts add up."""
    front, one, two = metrics(), metrics(), metrics()
    one.breaker_state.labels("gpu").set(1)
    two.breaker_state.labels("gpu").set(2)
    one.breaker_state.labels("embedded").set(1)
    two.breaker_state.labels("embedded").set(1)
    one.breaker_state.labels("triton").set(1)
    two.breaker_state.labels("triton").set(0)
    one.pool_healthy.labels("cpu").set(1)
    two.pool_healthy.labels("cpu").set(0)
    one.pool_healthy.labels("gpu-a100").set(1)
    two.pool_healthy.labels("gpu-a100").set(1)
    one.capture_active.set(1)
    two.capture_active.set(1)
    one.queue_depth.labels("cpu").set(3)
    two.queue_depth.labels("cpu").set(4)
    one.dedupe_entries.set(10)
    two.dedupe_entries.set(20)
    one.pending_replies.set(1)
    two.cpu_workers_busy.set(1)
    one.cpu_workers_busy.set(1)
    merged = samples(merge(text(front), [text(one), text(two)]))
    assert value(merged, f"{NS}_breaker_state", backend="gpu") == 2
    assert value(merged, f"{NS}_breaker_state", backend="embedded") == 1
    assert value(merged, f"{NS}_breaker_state", backend="triton") == 1
    assert value(merged, f"{NS}_pool_healthy", pool="cpu") == 0
    assert value(merged, f"{NS}_pool_healthy", pool="gpu-a100") == 1
    assert value(merged, f"{NS}_capture_active") == 1
    assert value(merged, f"{NS}_queue_depth", pool="cpu") == 7
    assert value(merged, f"{NS}_dedupe_entries") == 30
    assert value(merged, f"{NS}_pending_replies") == 1
    assert value(merged, f"{NS}_cpu_workers_busy") == 2
    # In the other order too (the first process's value is not simply kept).
    merged = samples(merge(text(front), [text(two), text(one)]))
    assert value(merged, f"{NS}_breaker_state", backend="gpu") == 2
    assert value(merged, f"{NS}_pool_healthy", pool="cpu") == 0


def classified_gauges(names: set[str]) -> dict[str, list[str]]:
    return {name: [k for k, members in GAUGE_SETS.items() if name in members] for name in sorted(names)}


def gauge_families(m: GatewayMetrics) -> set[str]:
    return {f.name for f in m.registry.collect() if f.type == "gauge" and f.name.startswith(f"{NS}_")}


def test_every_gateway_gauge_has_exactly_one_merge_rule() -> None:
    """A new gauge in GatewayMetrics must say how shards' values combine (no silent sum)."""
    gauges = gauge_families(metrics())
    assert len(gauges) >= 10  # the walk found the gateway's gauges
    wrong = {name: sets for name, sets in classified_gauges(gauges).items() if len(sets) != 1}
    assert not wrong, f"gauges in no set or in several: {wrong}"


def test_every_front_gauge_has_exactly_one_merge_rule(models_dir: Path) -> None:
    """The front's registry (GatewayMetrics and the front's own shard gauges) is what /metrics exports."""
    config = load_config(environ={}, overrides=loopback_overrides(models_dir))
    front = Front(config, 2)
    gauges = gauge_families(front.metrics)
    assert f"{NS}_shards_serving" in gauges
    wrong = {name: sets for name, sets in classified_gauges(gauges).items() if len(sets) != 1}
    assert not wrong, f"gauges in no set or in several: {wrong}"


def test_no_rule_names_a_counter_or_an_unknown_gauge(models_dir: Path) -> None:
    """The gauge rules (WORST, LEAST, ANY, SUMMED_GAUGES) name gauges that exist; FRONT_OWNED names
    families the front exports."""
    config = load_config(environ={}, overrides=loopback_overrides(models_dir))
    exported = {f.name: f.type for f in Front(config, 2).metrics.registry.collect()}
    for name in WORST | LEAST | ANY | SUMMED_GAUGES:
        assert exported.get(name) == "gauge", name
    assert set(exported) >= FRONT_OWNED, FRONT_OWNED - set(exported)


def test_retired_keeps_counters_monotonic_across_a_shard_restart() -> None:
    """A shard that restarts starts from zero: with its last incarnation retired, no merged counter or
    histogram sample goes down, and the dead incarnation's gauges are not kept."""
    front, old, other = metrics(), metrics(), metrics()
    old.accepted.labels("hgc").inc(10)
    old.responses.labels("ok", "edge_server", "cpu").inc(9)
    old.latency.labels("edge_server", "cpu").observe(0.01)
    old.queue_depth.labels("cpu").set(5)
    other.accepted.labels("hgc").inc(4)
    retired = Retired()
    before = merge(text(front), [text(old), text(other)], retired)
    # The shard dies; the front retires the last text it read from it. Its new incarnation did a little.
    retired.add(text(old))
    fresh = metrics()
    fresh.accepted.labels("hgc").inc(2)
    fresh.queue_depth.labels("cpu").set(1)
    after = merge(text(front), [text(fresh), text(other)], retired)
    was, now = samples(before), samples(after)
    kinds = sample_types(before)
    monotonic = {key for key in was if kinds[key[0]] in MONOTONIC}
    assert len(monotonic) > 10
    down = {key: (was[key], now.get(key)) for key in monotonic if now.get(key, 0.0) < was[key]}
    assert not down, f"counters went backwards: {down}"
    assert value(now, f"{NS}_requests_accepted_total", carrier="hgc") == 16
    assert value(now, f"{NS}_responses_total", status="ok", tier="edge_server", pool="cpu") == 9
    assert value(now, f"{NS}_request_latency_seconds_count", tier="edge_server", pool="cpu") == 1
    assert value(now, f"{NS}_queue_depth", pool="cpu") == 1  # a gauge: the live incarnation's only
    # Without the retired values the same merge would go backwards: the check above means something.
    bare = samples(merge(text(front), [text(fresh), text(other)]))
    assert value(bare, f"{NS}_requests_accepted_total", carrier="hgc") == 6


def test_retired_accumulates_over_several_incarnations_and_copies_apart() -> None:
    retired = Retired()
    for _ in range(3):
        dead = metrics()
        dead.accepted.labels("pccw").inc(5)
        retired.add(text(dead))
    snapshot = retired.copy()
    dead = metrics()
    dead.accepted.labels("pccw").inc(100)
    retired.add(text(dead))  # a later death does not change a copy taken before
    live = metrics()
    merged = samples(merge(text(metrics()), [text(live)], snapshot))
    assert value(merged, f"{NS}_requests_accepted_total", carrier="pccw") == 15
    merged = samples(merge(text(metrics()), [text(live)], retired))
    assert value(merged, f"{NS}_requests_accepted_total", carrier="pccw") == 115


def test_retired_does_not_resurrect_a_family_nobody_exports() -> None:
    dead = metrics()
    dead.accepted.labels("hgc").inc(3)
    retired = Retired()
    retired.add(
        text(dead) + "# HELP hkgw_gone_total gone\n# TYPE hkgw_gone_total counter\nhkgw_gone_total 4.0\n"
    )
    merged = samples(merge(text(metrics()), [], retired))
    assert value(merged, f"{NS}_requests_accepted_total", carrier="hgc") == 3
    assert not any(name.startswith(f"{NS}_gone") for name, _ in merged)


def test_merged_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus); cannot check the exposition")
    front, one, two = metrics(), metrics(), metrics()
    front.ready.set(1)
    front.carrier_up.labels("hgc").set(1)
    front.auth_rejected.labels("unknown_key").inc()
    for n, shard in enumerate((one, two)):
        shard.accepted.labels("hgc").inc(n + 1)
        shard.latency.labels("edge_server", "cpu").observe(0.01 * (n + 1))
        shard.batch_size.labels("cpu").observe(8)
        shard.breaker_state.labels("embedded").set(n)
        shard.pool_healthy.labels("cpu").set(1)
        shard.queue_depth.labels("cpu").set(n)
        shard.carrier_up.labels("hgc").set(1)
    retired = Retired()
    retired.add(text(one))
    body = merge(text(front), [text(one), text(two)], retired)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30, check=False
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert types(body)[f"{NS}_requests_accepted"] == "counter"
