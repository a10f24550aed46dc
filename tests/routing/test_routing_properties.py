"""Properties of TierPolicy over generated requests, signals and configs (hypothesis)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from routing import (
    PoolSignals,
    Priority,
    Reason,
    RequestKind,
    RequestProfile,
    TierPolicy,
    default_routing_config,
    load_routing_config,
)
from routing.types import SPILLOVER_REASONS

DEFAULT = default_routing_config()
POLICY = TierPolicy(DEFAULT)
POOL_NAMES = [p.name for p in DEFAULT.pools]
MODEL_KINDS = {
    "rank-mlp": RequestKind.RANKING,
    "text-encoder": RequestKind.TEXT,
    "image-classifier": RequestKind.IMAGE,
}
REGIONS = ["unknown", "us-west", "eu-west", "ap-northeast-1", "mars"]

signals_st = st.builds(
    PoolSignals,
    queue_depth=st.integers(0, 400),
    ewma_latency_s=st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05]),
    healthy=st.booleans(),
    concurrency=st.integers(0, 32),
)
signal_map_st = st.dictionaries(st.sampled_from(POOL_NAMES), signals_st)
deadline_st = st.one_of(st.none(), st.floats(0.0005, 2.0))


def sized(kind: RequestKind, model: str, work: int, **fields: Any) -> RequestProfile:
    """A profile of ``kind`` whose work measure is ``work``."""
    if kind is RequestKind.RANKING:
        fields.update(candidates=work, feature_width=1)
    elif kind is RequestKind.TEXT:
        fields.update(text_tokens=work)
    elif kind is RequestKind.IMAGE:
        fields.update(pixels=work)
    else:
        fields.update(tensor_elements=work)
    return RequestProfile(kind, model, **fields)


@given(
    model=st.sampled_from(sorted(MODEL_KINDS)),
    works=st.tuples(st.integers(0, 1 << 25), st.integers(0, 1 << 25)),
    hints=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    priority=st.sampled_from(list(Priority)),
    deadline=deadline_st,
    signals=signal_map_st,
)
def test_more_complex_never_lands_lower_without_spillover(
    *,
    model: str,
    works: tuple[int, int],
    hints: tuple[float, float],
    priority: Priority,
    deadline: float | None,
    signals: dict[str, PoolSignals],
) -> None:
    """A more complex request lands on a lower tier than a simpler one only for spillover or deadline."""
    low, high = sorted(works)
    simple = sized(MODEL_KINDS[model], model, low, priority=priority, remaining_deadline_s=deadline)
    simple = replace(simple, client_hint=min(hints))
    complex_ = replace(
        sized(MODEL_KINDS[model], model, high, priority=priority, remaining_deadline_s=deadline),
        client_hint=max(hints),
    )
    a, b = POLICY.decide(simple, signals), POLICY.decide(complex_, signals)
    assert b.score >= a.score
    if not a.rejected and not b.rejected and b.tier.rank < a.tier.rank:
        assert b.reason in SPILLOVER_REASONS


@given(
    model=st.sampled_from(sorted(MODEL_KINDS)),
    works=st.tuples(st.integers(0, 1 << 25), st.integers(0, 1 << 25)),
    priority=st.sampled_from(list(Priority)),
    region=st.sampled_from(REGIONS),
)
def test_agent_tier_is_monotonic(model: str, works: tuple[int, int], priority: Priority, region: str) -> None:
    """The agent's complexity-only tier never decreases as a request grows."""
    low, high = sorted(works)
    fields: dict[str, Any] = {"priority": priority, "region": region}
    a = POLICY.tier_for(sized(MODEL_KINDS[model], model, low, **fields))
    b = POLICY.tier_for(sized(MODEL_KINDS[model], model, high, **fields))
    assert b.tier.rank >= a.tier.rank


pool_st = st.fixed_dictionaries(
    {
        "tier": st.sampled_from(["edge_server", "cloud"]),
        "models": st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True),
        "priorities": st.lists(st.sampled_from(list(Priority)), min_size=1, max_size=3, unique=True),
        "speed": st.floats(0.5, 10),
        "concurrency": st.integers(1, 16),
        "max_queue_depth": st.integers(1, 100),
    }
)
config_st = st.builds(
    lambda pools, spill_down, region_pools: {
        "models": {"a": {"kind": "ranking"}, "b": {"kind": "text"}, "c": {"kind": "image"}},
        "pools": [{"name": f"p{i}", **pool} for i, pool in enumerate(pools)],
        "spill_down": spill_down,
        "regions": {"us-west": {"pools": [f"p{i}" for i in range(len(pools)) if i in region_pools]}},
    },
    st.lists(pool_st, min_size=1, max_size=6),
    st.booleans(),
    st.sets(st.integers(0, 5)),
)


@given(
    section=config_st,
    model=st.sampled_from(["a", "b", "c", "zzz"]),
    work=st.integers(0, 1 << 25),
    priority=st.sampled_from(list(Priority)),
    region=st.sampled_from(REGIONS),
    deadline=deadline_st,
    data=st.data(),
)
def test_decision_never_names_pool_lacking_model(
    *,
    section: dict[str, Any],
    model: str,
    work: int,
    priority: Priority,
    region: str,
    deadline: float | None,
    data: st.DataObject,
) -> None:
    """A chosen pool always serves the model and takes the priority; a served request meets its deadline."""
    config = load_routing_config(section)
    names = [p["name"] for p in section["pools"]]
    signals = data.draw(st.dictionaries(st.sampled_from(names), signals_st))
    kind = {"a": RequestKind.RANKING, "b": RequestKind.TEXT}.get(model, RequestKind.IMAGE)
    profile = sized(kind, model, work, priority=priority, region=region, remaining_deadline_s=deadline)
    decision = TierPolicy(config).decide(profile, signals)
    if decision.pool is None:
        assert decision.rejected
        return
    pool = next(p for p in config.pools if p.name == decision.pool)
    assert model in pool.models and priority in pool.priorities and pool.tier is decision.tier
    if deadline is not None:
        assert decision.est_latency_s is not None and decision.est_latency_s <= deadline


@given(
    model=st.sampled_from(sorted(MODEL_KINDS)),
    work=st.integers(0, 1 << 25),
    priority=st.sampled_from(list(Priority)),
    deadline=st.floats(0.0005, 0.5),
    signals=signal_map_st,
)
def test_deadline_reject_only_when_no_pool_can_finish(
    model: str, work: int, priority: Priority, deadline: float, signals: dict[str, PoolSignals]
) -> None:
    """reject_deadline means every healthy, unsaturated pool for the request would finish too late."""
    profile = sized(MODEL_KINDS[model], model, work, priority=priority, remaining_deadline_s=deadline)
    decision = POLICY.decide(profile, signals)
    if decision.reason is not Reason.REJECT_DEADLINE:
        return
    for pool in DEFAULT.pools:
        sig = signals.get(pool.name)
        if model not in pool.models or priority not in pool.priorities or sig is None or not sig.healthy:
            continue
        if sig.queue_depth < pool.max_queue_depth:
            assert POLICY.estimate_latency(profile, pool.name, sig) > deadline


@given(
    model=st.sampled_from([*sorted(MODEL_KINDS), "nope"]),
    work=st.integers(0, 1 << 25),
    hint=st.floats(allow_nan=True, allow_infinity=True),
    deadline=deadline_st,
    signals=signal_map_st,
)
def test_decisions_are_deterministic(
    model: str, work: int, hint: float, deadline: float | None, signals: dict[str, PoolSignals]
) -> None:
    """Equal inputs give equal decisions from a fresh policy, whatever the order of the signals."""
    kind = MODEL_KINDS.get(model, RequestKind.TENSOR)
    profile = replace(sized(kind, model, work, remaining_deadline_s=deadline), client_hint=hint)
    first = POLICY.decide(profile, signals)
    again = TierPolicy(DEFAULT).decide(profile, dict(reversed(list(signals.items()))))
    assert first == again
    assert 0.0 <= first.score <= 1.0 and not math.isnan(first.score)
