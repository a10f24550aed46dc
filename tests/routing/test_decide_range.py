"""TierPolicy.decide_range: one decision for a group of requests, exactly what decide() makes for each.

The frame path routes a frame's requests per group with it; if it ever returned a decision that decide()
would not make for some member, routing would change with the frame path. Checked over generated groups,
signals and depth ranges (hypothesis), at the corners of the ranges and at points inside them.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from routing import (
    Decision,
    PoolSignals,
    Priority,
    RequestProfile,
    TierPolicy,
    Unproven,
    default_routing_config,
)
from routing.calibration import LatencyCalibrator
from tests.routing.test_routing_properties import MODEL_KINDS, POOL_NAMES, REGIONS, sized

DEFAULT = default_routing_config()
POLICY = TierPolicy(DEFAULT)
signals_st = st.builds(
    PoolSignals,
    queue_depth=st.integers(0, 300),
    ewma_latency_s=st.sampled_from([0.0, 0.0005, 0.002, 0.01, 0.05]),
    healthy=st.booleans(),
    concurrency=st.integers(0, 32),
)


def _key(decision: object) -> tuple[object, ...]:
    return (
        getattr(decision, "tier", None),
        getattr(decision, "pool", None),
        getattr(decision, "reason", None),
        getattr(decision, "size_bucket", None),
    )


@settings(max_examples=400, deadline=None)
@given(
    model=st.sampled_from(sorted(MODEL_KINDS)),
    works=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=6),
    hints=st.lists(st.floats(0, 1), min_size=1, max_size=3),
    deadlines=st.one_of(st.none(), st.lists(st.floats(0.0005, 0.5), min_size=1, max_size=3)),
    priority=st.sampled_from(list(Priority)),
    region=st.sampled_from(REGIONS),
    signals=st.dictionaries(st.sampled_from(POOL_NAMES), signals_st),
    added=st.lists(st.integers(0, 120), min_size=len(POOL_NAMES), max_size=len(POOL_NAMES)),
    points=st.lists(
        st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)), max_size=4
    ),
)
def test_a_group_decision_is_every_member_decision(
    *,
    model: str,
    works: list[int],
    hints: list[float],
    deadlines: list[float] | None,
    priority: Priority,
    region: str,
    signals: dict[str, PoolSignals],
    added: list[int],
    points: list[tuple[float, float, float, float]],
) -> None:
    kind = MODEL_KINDS[model]
    # One size bucket per group (as the frame path groups): the works' common power of two.
    bucket = max(works).bit_length()
    works = [max(w, 1 << (bucket - 1)) for w in works]
    depth_high = {
        name: sig.queue_depth + add for (name, sig), add in zip(signals.items(), added, strict=False)
    }

    def member(work: int, hint: float, deadline: float | None) -> RequestProfile:
        profile = sized(kind, model, work, priority=priority, remaining_deadline_s=deadline, region=region)
        return replace(profile, client_hint=hint)

    tight = None if deadlines is None else min(deadlines)
    loose = None if deadlines is None else max(deadlines)
    low = member(min(works), min(hints), tight)
    high = member(max(works), max(hints), loose)
    group = POLICY.decide_range(low, high, signals, depth_high)
    if isinstance(group, Unproven):
        return
    corners = [
        (w, h, d) for w in (min(works), max(works)) for h in (min(hints), max(hints)) for d in (tight, loose)
    ]
    for work, hint, deadline in corners:
        for deep in (False, True):
            at = {
                name: replace(sig, queue_depth=depth_high[name]) if deep else sig
                for name, sig in signals.items()
            }
            assert _key(POLICY.decide(member(work, hint, deadline), at)) == _key(group)
    for fw, fh, fd, fq in points:
        work = int(min(works) + fw * (max(works) - min(works)))
        hint = min(hints) + fh * (max(hints) - min(hints))
        deadline = None if tight is None or loose is None else tight + fd * (loose - tight)
        at = {
            name: replace(sig, queue_depth=sig.queue_depth + int(fq * (depth_high[name] - sig.queue_depth)))
            for name, sig in signals.items()
        }
        assert _key(POLICY.decide(member(work, hint, deadline), at)) == _key(group)


def test_an_ordinary_group_gets_one_decision() -> None:
    """Not None all the time: a group of ranking requests of one bucket on idle pools is decided once."""
    signals = {name: PoolSignals() for name in POOL_NAMES}
    low = sized(MODEL_KINDS["rank-mlp"], "rank-mlp", 520, remaining_deadline_s=4.0)
    high = sized(MODEL_KINDS["rank-mlp"], "rank-mlp", 1000, remaining_deadline_s=5.0)
    deeper = {name: 30 for name in POOL_NAMES}  # the default cpu pool holds 64
    group = POLICY.decide_range(low, high, signals, deeper)
    assert isinstance(group, Decision) and group.pool is not None
    assert _key(group) == _key(POLICY.decide(low, signals)) == _key(POLICY.decide(high, signals))


def test_members_of_two_size_buckets_are_not_one_group() -> None:
    """Calibration is per size bucket: a range across two buckets is never decided as one."""
    calibrated = TierPolicy(DEFAULT, LatencyCalibrator(DEFAULT.calibration.alpha))
    signals = {name: PoolSignals() for name in POOL_NAMES}
    low = sized(MODEL_KINDS["rank-mlp"], "rank-mlp", 500)
    high = sized(MODEL_KINDS["rank-mlp"], "rank-mlp", 600)
    assert calibrated.decide_range(low, high, signals, {}) is Unproven.SCORES


def test_a_pool_that_may_fill_within_the_frame_is_decided_per_request() -> None:
    """Queue depth near the limit: some members would find the pool saturated, so no group decision."""
    limit = {p.name: p.max_queue_depth for p in DEFAULT.pools}
    signals = {name: PoolSignals(queue_depth=limit[name] - 2) for name in POOL_NAMES}
    deeper = {name: limit[name] + 5 for name in POOL_NAMES}
    profile = sized(MODEL_KINDS["rank-mlp"], "rank-mlp", 600)
    assert POLICY.decide_range(profile, profile, signals, deeper) is Unproven.POOLS
