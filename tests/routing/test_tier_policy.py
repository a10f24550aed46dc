"""TierPolicy.decide and TierPolicy.tier_for against the demo config, one table row per reason code."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest

from routing import (
    Decision,
    PoolSignals,
    Priority,
    Reason,
    RequestKind,
    RequestProfile,
    Tier,
    TierPolicy,
    default_routing_config,
    load_routing_config,
)
from routing.config import DEFAULT_ROUTING_SECTION
from routing.testing import pool_signals

# Scores under the demo cost model: SMALL 0.19 (edge device), MID 0.57 (edge server), BIG 0.88 (cloud).
SMALL = RequestProfile(RequestKind.RANKING, "rank-mlp", candidates=50, feature_width=32)
MID = RequestProfile(RequestKind.RANKING, "rank-mlp", candidates=1000, feature_width=64)
BIG = RequestProfile(RequestKind.RANKING, "rank-mlp", candidates=10000, feature_width=128)
SHORT_TEXT = RequestProfile(RequestKind.TEXT, "text-encoder", text_chars=40)

FULL = PoolSignals(queue_depth=1000)
DOWN = PoolSignals(healthy=False)
ALL_POOLS = ("cpu", "gpu-a100-mig", "gpu-a100", "gpu-v100")


def config_with(**changes: Any) -> dict[str, Any]:
    """The demo routing section with top-level keys replaced or merged (``models`` is merged per model)."""
    section = dict(DEFAULT_ROUTING_SECTION)
    for key, value in changes.items():
        if key == "models":
            section["models"] = {
                name: {**section["models"].get(name, {}), **value.get(name, {})}
                for name in section["models"] | value
            }
        else:
            section[key] = value
    return section


PINNED_SECTION = config_with(
    models={
        "rank-mlp": {"version_pins": {"canary": "gpu-v100"}},
        "text-encoder": {"pin_tier": "cloud"},
    },
    regions={
        "us-west": {"pools": ["gpu-v100"]},
        "eu-west": {"thresholds": {"edge_server": 0.1, "cloud": 0.5}},
    },
)


@dataclass(frozen=True)
class Row:
    """One table row: profile and signal overrides in, expected tier, pool and reason out."""

    name: str
    profile: RequestProfile
    signals: dict[str, PoolSignals]
    tier: Tier
    pool: str | None
    reason: Reason
    section: dict[str, Any] | None = None
    missing: tuple[str, ...] = ()


ROWS = [
    Row("complexity_edge_server", MID, {}, Tier.EDGE_SERVER, "cpu", Reason.COMPLEXITY),
    Row("complexity_small_lifted_to_edge_server", SMALL, {}, Tier.EDGE_SERVER, "cpu", Reason.COMPLEXITY),
    Row("complexity_cloud_fastest_pool", BIG, {}, Tier.CLOUD, "gpu-a100", Reason.COMPLEXITY),
    Row(
        "complexity_realtime_low_latency_pool",
        replace(BIG, priority=Priority.REALTIME),
        {},
        Tier.CLOUD,
        "gpu-a100-mig",
        Reason.COMPLEXITY,
    ),
    Row(
        "complexity_busy_pool_avoided",
        BIG,
        {"gpu-a100": PoolSignals(queue_depth=200, ewma_latency_s=0.01)},
        Tier.CLOUD,
        "gpu-v100",
        Reason.COMPLEXITY,
    ),
    Row(
        "complexity_region_thresholds",
        replace(MID, region="eu-west"),
        {},
        Tier.CLOUD,
        "gpu-a100",
        Reason.COMPLEXITY,
        PINNED_SECTION,
    ),
    Row(
        "model_pinned_version",
        replace(MID, model_version="canary"),
        {},
        Tier.CLOUD,
        "gpu-v100",
        Reason.MODEL_PINNED,
        PINNED_SECTION,
    ),
    Row("model_pinned_tier", SHORT_TEXT, {}, Tier.CLOUD, "gpu-a100", Reason.MODEL_PINNED, PINNED_SECTION),
    Row("spillover_saturated_up", MID, {"cpu": FULL}, Tier.CLOUD, "gpu-a100", Reason.SPILLOVER_SATURATED),
    Row(
        "spillover_saturated_down",
        BIG,
        {"gpu-a100-mig": FULL, "gpu-a100": FULL, "gpu-v100": FULL},
        Tier.EDGE_SERVER,
        "cpu",
        Reason.SPILLOVER_SATURATED,
    ),
    Row("spillover_unhealthy", MID, {"cpu": DOWN}, Tier.CLOUD, "gpu-a100", Reason.SPILLOVER_UNHEALTHY),
    Row(
        "spillover_unhealthy_no_signals",
        MID,
        {},
        Tier.CLOUD,
        "gpu-a100",
        Reason.SPILLOVER_UNHEALTHY,
        missing=("cpu",),
    ),
    Row(
        "deadline",
        replace(MID, remaining_deadline_s=0.02),
        {},
        Tier.CLOUD,
        "gpu-a100",
        Reason.DEADLINE,
    ),
    Row(
        "reject_overloaded",
        MID,
        dict.fromkeys(ALL_POOLS, FULL),
        Tier.EDGE_SERVER,
        None,
        Reason.REJECT_OVERLOADED,
    ),
    Row(
        "reject_unavailable",
        MID,
        dict.fromkeys(ALL_POOLS, DOWN),
        Tier.EDGE_SERVER,
        None,
        Reason.REJECT_UNAVAILABLE,
    ),
    Row(
        "reject_deadline",
        replace(BIG, remaining_deadline_s=0.001),
        {},
        Tier.CLOUD,
        None,
        Reason.REJECT_DEADLINE,
    ),
    Row(
        "reject_deadline_expired",
        replace(SMALL, remaining_deadline_s=0.0),
        {},
        Tier.EDGE_SERVER,
        None,
        Reason.REJECT_DEADLINE,
    ),
    Row(
        "reject_no_model",
        replace(MID, model="no-such-model"),
        {},
        Tier.EDGE_SERVER,
        None,
        Reason.REJECT_NO_MODEL,
    ),
    Row(
        "reject_no_pool",
        RequestProfile(RequestKind.IMAGE, "image-classifier", pixels=50176, region="us-west"),
        {},
        Tier.EDGE_SERVER,
        None,
        Reason.REJECT_NO_POOL,
        PINNED_SECTION,
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_decide_table(row: Row) -> None:
    """Each scenario lands on its expected tier and pool with its expected reason."""
    config = load_routing_config(row.section or DEFAULT_ROUTING_SECTION)
    signals = pool_signals(config, row.signals)
    for name in row.missing:
        del signals[name]
    decision = TierPolicy(config).decide(row.profile, signals)
    assert (decision.tier, decision.pool, decision.reason) == (row.tier, row.pool, row.reason)


def test_every_reason_has_a_table_row() -> None:
    """The decide table covers every reason code."""
    assert {row.reason for row in ROWS} == set(Reason)


def test_rejected_decision_names_no_pool() -> None:
    """A rejection has no pool and reports rejected; a served decision the opposite."""
    policy = TierPolicy(default_routing_config())
    served = policy.decide(MID, pool_signals(policy.config))
    rejected = policy.decide(MID, {})
    assert (served.rejected, rejected.rejected) == (False, True)
    assert rejected.pool is None and rejected.est_latency_s is None


def test_served_decision_meets_deadline() -> None:
    """A served decision's estimated finish time is within the remaining deadline."""
    policy = TierPolicy(default_routing_config())
    decision = policy.decide(replace(MID, remaining_deadline_s=0.02), pool_signals(policy.config))
    assert decision.est_latency_s is not None and decision.est_latency_s <= 0.02


def test_deadline_slack_is_reserved() -> None:
    """deadline_slack_s is taken off the remaining deadline before pools are judged."""
    policy = TierPolicy(load_routing_config(config_with(deadline_slack_s=0.03)))
    decision = policy.decide(replace(MID, remaining_deadline_s=0.04), pool_signals(policy.config))
    assert (decision.pool, decision.reason) == ("gpu-a100", Reason.DEADLINE)


def test_spill_down_can_be_disabled() -> None:
    """With spill_down false a saturated top tier rejects instead of falling back to the edge server."""
    policy = TierPolicy(load_routing_config(config_with(spill_down=False)))
    full = {"gpu-a100-mig": FULL, "gpu-a100": FULL, "gpu-v100": FULL}
    assert policy.decide(BIG, pool_signals(policy.config, full)).reason is Reason.REJECT_OVERLOADED


def test_client_hint_raises_tier() -> None:
    """A high client hint sends a small request to the cloud."""
    policy = TierPolicy(default_routing_config())
    decision = policy.decide(replace(SMALL, client_hint=0.95), pool_signals(policy.config))
    assert (decision.tier, decision.score) == (Tier.CLOUD, 0.95)


def test_queue_wait_counts_toward_deadline() -> None:
    """A pool whose queue would make the request late is passed over for one that is not."""
    policy = TierPolicy(default_routing_config())
    busy = {"cpu": PoolSignals(queue_depth=40, ewma_latency_s=0.01)}
    decision = policy.decide(replace(SMALL, remaining_deadline_s=0.03), pool_signals(policy.config, busy))
    assert (decision.tier, decision.reason) == (Tier.CLOUD, Reason.DEADLINE)


def test_a_request_waits_only_behind_the_requests_as_urgent_or_more_where_the_pool_serves_by_class() -> None:
    """The CPU pool holds 40 requests, 10 ms each: a request with 30 ms left passes it over (as above)
    unless the pool serves by class (PoolSignals.urgent_depth) and few of them are as urgent as it."""
    policy = TierPolicy(default_routing_config())
    late = replace(SMALL, remaining_deadline_s=0.03)
    by_class = PoolSignals(
        queue_depth=40, ewma_latency_s=0.01, urgent_depth=(1, 4)
    )  # 1 realtime, 3 interactive
    signals = pool_signals(policy.config, {"cpu": by_class})
    realtime = policy.decide(replace(late, priority=Priority.REALTIME), signals)
    interactive = policy.decide(replace(late, priority=Priority.INTERACTIVE), signals)
    batch = policy.decide(replace(late, priority=Priority.BATCH), signals)
    assert (realtime.pool, realtime.reason) == ("cpu", Reason.COMPLEXITY)
    assert (interactive.pool, interactive.reason) == ("cpu", Reason.COMPLEXITY)
    assert (batch.tier, batch.reason) == (Tier.CLOUD, Reason.DEADLINE)  # behind all 40
    assert realtime.est_latency_s is not None and interactive.est_latency_s is not None
    assert realtime.est_latency_s < interactive.est_latency_s  # behind 1, then behind 4
    first_come = PoolSignals(queue_depth=40, ewma_latency_s=0.01)  # no classes known: the whole queue
    again = policy.decide(
        replace(late, priority=Priority.REALTIME), pool_signals(policy.config, {"cpu": first_come})
    )
    assert (again.tier, again.reason) == (Tier.CLOUD, Reason.DEADLINE)


def test_joined_and_deepened_grow_the_waits_a_class_sees() -> None:
    sig = PoolSignals(queue_depth=10, urgent_depth=(2, 5))
    assert [sig.waiting_for(p) for p in (Priority.REALTIME, Priority.INTERACTIVE, Priority.BATCH)] == [
        2,
        5,
        10,
    ]
    assert sig.joined(Priority.REALTIME).urgent_depth == (3, 6)
    assert sig.joined(Priority.INTERACTIVE, 2).urgent_depth == (2, 7)
    assert sig.joined(Priority.BATCH) == PoolSignals(queue_depth=11, urgent_depth=(2, 5))
    assert sig.deepened(14) == PoolSignals(queue_depth=14, urgent_depth=(6, 9))  # an upper bound for each
    assert sig.deepened(10) is sig
    assert PoolSignals(queue_depth=3).joined(Priority.REALTIME).waiting_for(Priority.REALTIME) == 4


def test_live_concurrency_overrides_config() -> None:
    """PoolSignals.concurrency, when set, replaces the pool's configured concurrency in the wait estimate."""
    policy = TierPolicy(default_routing_config())
    slow = PoolSignals(queue_depth=8, ewma_latency_s=0.01)
    wide = PoolSignals(queue_depth=8, ewma_latency_s=0.01, concurrency=80)
    assert policy.estimate_latency(MID, "cpu", wide) < policy.estimate_latency(MID, "cpu", slow)


def test_decision_is_deterministic() -> None:
    """The same profile and signals give equal decisions, whatever the signals' order or the policy object."""
    config = default_routing_config()
    signals = pool_signals(config, {"gpu-a100": PoolSignals(queue_depth=3, ewma_latency_s=0.001)})
    reordered = dict(reversed(list(signals.items())))
    first: Decision = TierPolicy(config).decide(BIG, signals)
    assert TierPolicy(config).decide(BIG, reordered) == first


def test_ties_go_to_config_order() -> None:
    """Two pools with equal estimates: the one listed first in the config wins."""
    section = config_with(
        pools=[
            {"name": "zeta", "tier": "edge_server", "models": ["rank-mlp"]},
            {"name": "alpha", "tier": "edge_server", "models": ["rank-mlp"]},
        ]
    )
    policy = TierPolicy(load_routing_config(section))
    assert policy.decide(MID, pool_signals(policy.config)).pool == "zeta"


def test_tier_for_small_request_stays_on_device() -> None:
    """The agent's complexity-only answer keeps a small request on the device."""
    decision = TierPolicy(default_routing_config()).tier_for(SMALL)
    assert (decision.tier, decision.pool, decision.reason) == (Tier.EDGE_DEVICE, None, Reason.COMPLEXITY)


@pytest.mark.parametrize(
    ("profile", "tier"),
    [(MID, Tier.EDGE_SERVER), (BIG, Tier.CLOUD)],
    ids=["mid", "big"],
)
def test_tier_for_larger_request_goes_remote(profile: RequestProfile, tier: Tier) -> None:
    """The agent's answer for larger requests is the remote tier their score selects."""
    assert TierPolicy(default_routing_config()).tier_for(profile).tier is tier


def test_tier_for_model_not_on_device() -> None:
    """A model agents cannot serve locally goes to the nearest remote tier."""
    policy = TierPolicy(load_routing_config(config_with(models={"rank-mlp": {"on_device": False}})))
    assert policy.tier_for(SMALL).tier is Tier.EDGE_SERVER


def test_tier_for_pinned_version() -> None:
    """A pinned version is sent to its pool's tier with reason model_pinned."""
    decision = TierPolicy(load_routing_config(PINNED_SECTION)).tier_for(
        replace(SMALL, model_version="canary")
    )
    assert (decision.tier, decision.reason) == (Tier.CLOUD, Reason.MODEL_PINNED)


def test_tier_for_unknown_model_rejects() -> None:
    """The agent learns early that no one serves an unknown model."""
    decision = TierPolicy(default_routing_config()).tier_for(replace(SMALL, model="nope"))
    assert decision.reason is Reason.REJECT_NO_MODEL and decision.rejected


def test_observe_scales_by_pool_speed() -> None:
    """observe() stores the latency as if served on a speed-1.0 pool."""
    policy = TierPolicy(default_routing_config())
    decision = policy.decide(BIG, pool_signals(policy.config))
    policy.observe("rank-mlp", decision, 0.01)
    estimate = policy.calibrator.estimate("rank-mlp", decision.size_bucket)
    assert estimate is not None and estimate.latency_s == pytest.approx(0.08)


def test_observe_needs_a_pool() -> None:
    """Observing a decision that named no pool is an error."""
    policy = TierPolicy(default_routing_config())
    with pytest.raises(ValueError, match="named a pool"):
        policy.observe("rank-mlp", policy.tier_for(SMALL), 0.01)


def test_calibration_moves_request_to_cloud() -> None:
    """Observed slow service for a size bucket raises its score until it routes to the cloud."""
    policy = TierPolicy(default_routing_config())
    bucket = policy.estimator.size_bucket(MID)
    for _ in range(policy.config.calibration.min_samples):
        policy.calibrator.observe("rank-mlp", bucket, 0.3)
    assert policy.decide(MID, pool_signals(policy.config)).tier is Tier.CLOUD
