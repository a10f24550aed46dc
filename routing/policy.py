"""TierPolicy: a request profile and live pool signals in, a :class:`Decision` out.

The gateway calls :meth:`TierPolicy.decide` with the signals of its pools; the edge agent, which has no
view of Hong Kong's pools, calls :meth:`TierPolicy.tier_for` to learn whether to serve a request locally.
Both are pure functions of the profile, the signals, the config and the calibrator's state.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

from routing.calibration import LatencyCalibrator
from routing.complexity import ComplexityEstimator
from routing.config import RoutingConfig
from routing.plan import PoolSpec, RoutePlan, build_plan
from routing.types import Decision, PoolSignals, Priority, Reason, RequestProfile, Tier

_PlanKey = tuple[str, str, str, str]


def pool_latency(pool: PoolSpec, signals: PoolSignals, service_ref_s: float, priority: Priority) -> float:
    """Estimated time for a request of class ``priority`` to finish on ``pool``: queue wait plus its own
    service time.

    ``service_ref_s`` is the request's service time on a speed-1.0 pool. The wait is the part of the queue
    served before it (:meth:`PoolSignals.waiting_for`: those as urgent or more where the pool serves by
    class, else all) drained through the pool's concurrency at the pool's observed per-item latency (or the
    request's own service time while none is observed).
    """
    own = service_ref_s / pool.speed
    per_item = signals.ewma_latency_s if signals.ewma_latency_s > 0.0 else own
    concurrency = signals.concurrency if signals.concurrency > 0 else pool.concurrency
    return own + signals.waiting_for(priority) * per_item / concurrency


class Unproven(enum.Enum):
    """Why :meth:`TierPolicy.decide_range` gave no decision for a group."""

    SCORES = "scores"
    """The group's scores straddle a tier threshold, or its work two size buckets."""
    POOLS = "pools"
    """The pools' estimates, depths or the deadlines leave the choice open somewhere in the range."""


class TierPolicy:
    """The routing policy of one validated :class:`RoutingConfig`.

    ``calibrator`` receives observed latencies (through :meth:`observe` or directly) and shifts scores
    once a (model, size bucket) has enough samples; pass the previous policy's calibrator on reload to keep
    what it learned.
    """

    __slots__ = ("_estimator", "_names", "_plans", "_pools", "_slack", "calibrator", "config")

    def __init__(self, config: RoutingConfig, calibrator: LatencyCalibrator | None = None) -> None:
        self.config = config
        self.calibrator = calibrator or LatencyCalibrator(config.calibration.alpha)
        self._estimator = ComplexityEstimator(config.cost, config.calibration, self.calibrator)
        self._pools = {p.name: PoolSpec.of(p) for p in config.pools}
        self._names = tuple(self._pools)
        self._slack = config.deadline_slack_s
        self._plans: dict[_PlanKey, RoutePlan] = {}

    @property
    def estimator(self) -> ComplexityEstimator:
        """The complexity estimator this policy scores with."""
        return self._estimator

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Configured pools in config order."""
        return self._names

    def _plan(self, profile: RequestProfile) -> RoutePlan:
        model_cfg = self.config.models.get(profile.model)
        if model_cfg is None:
            # Model names come from clients; unknown ones are not cached, so the cache stays bounded.
            return build_plan(self.config, profile.model, "", profile.priority, profile.region)
        version = profile.model_version if profile.model_version in model_cfg.version_pins else ""
        region = profile.region if profile.region in self.config.regions else ""
        key = (profile.model, version, profile.priority, region)  # a StrEnum: the member is its value's str
        plan = self._plans.get(key)
        if plan is None:
            plan = build_plan(self.config, profile.model, version, profile.priority, region)
            self._plans[key] = plan
        return plan

    def score(self, profile: RequestProfile) -> float:
        """The request's complexity score in [0, 1] under this policy's cost model and calibration."""
        return self._estimator.score(profile, self._plan(profile).cost_factor)[0]

    def tier_for(self, profile: RequestProfile) -> Decision:
        """Complexity-only decision for the edge agent: ``EDGE_DEVICE`` means serve locally.

        Uses no pool signals; ``pool`` is always None. Rejects only when nothing, device included, serves
        the model for this priority and region.
        """
        plan = self._plan(profile)
        score, bucket = self._estimator.score(profile, plan.cost_factor)
        rank = _rank(score, plan)
        tier = plan.agent_tier[rank]
        if tier is None:
            return Decision(
                plan.remote_tier[rank], None, plan.empty_reason or Reason.REJECT_NO_POOL, score, None, bucket
            )
        return Decision(tier, None, plan.base_reason, score, None, bucket)

    def decide(self, profile: RequestProfile, signals: Mapping[str, PoolSignals]) -> Decision:
        """Choose a tier and pool for the request given each pool's live signals.

        Tiers are tried from the score's tier (the nearest that has a pool for the model) upwards, then
        downwards; within a tier the pool with the lowest estimated finish time wins, ties going to config
        order. A pool is skipped when unhealthy or absent from ``signals``, saturated (queue at its limit),
        or unable to finish before the deadline. The reason names why the first tier was left, or why
        nothing could serve.
        """
        plan = self._plan(profile)
        score, bucket = self._estimator.score(profile, plan.cost_factor)
        rank = _rank(score, plan)
        if plan.empty_reason is not None:
            return Decision(plan.remote_tier[rank], None, plan.empty_reason, score, None, bucket)
        deadline = profile.remaining_deadline_s
        if deadline is None:
            budget = math.inf
        else:
            budget = deadline - self._slack
            if budget <= 0.0:
                return Decision(plan.remote_tier[rank], None, Reason.REJECT_DEADLINE, score, None, bucket)
        service_ref = self._estimator.service_time(profile, score, bucket)
        left: Reason | None = None
        any_slow = any_saturated = False
        for tier, pools in plan.order[rank]:
            best: PoolSpec | None = None
            best_est = math.inf
            slow = saturated = False
            for pool in pools:
                sig = signals.get(pool.name)
                if sig is None or not sig.healthy:
                    continue
                if sig.queue_depth >= pool.max_queue_depth:
                    saturated = True
                    continue
                est = pool_latency(pool, sig, service_ref, profile.priority)
                if est > budget:
                    slow = True
                elif est < best_est:
                    best, best_est = pool, est
            if best is not None:
                return Decision(tier, best.name, left or plan.base_reason, score, best_est, bucket)
            if left is None:
                left = _left_because(slow, saturated)
            any_slow = any_slow or slow
            any_saturated = any_saturated or saturated
        reject = _rejected_because(any_slow, any_saturated)
        return Decision(plan.remote_tier[rank], None, reject, score, None, bucket)

    def decide_range(
        self,
        low: RequestProfile,
        high: RequestProfile,
        signals: Mapping[str, PoolSignals],
        depth_high: Mapping[str, int],
    ) -> Decision | Unproven:
        """One decision that :meth:`decide` provably makes for every request of a group, or why not.

        The group's requests share kind, model, version, priority and region; ``low`` and ``high`` bound
        the rest field by field: work (``low`` holds the sizes of the least work, ``high`` of the most),
        client hint and remaining deadline (both None or neither). Each pool's queue depth lies between
        its ``signals`` depth and ``depth_high`` (what the frame being routed may add to it before a
        member is decided). The frame path routes a group with one call instead of one per request.

        Why it is exact: the score rises with work and hint (log scale, calibration blend and hint are
        monotone; the calibrated estimate is per size bucket, so both ends must share one), hence so do
        the service time and every pool's estimate, which also rises with the queue the group's class
        waits behind (the whole queue, or its lanes as urgent or more: :meth:`PoolSignals.waiting_for`),
        which grows by no more than the queue does (:meth:`PoolSignals.deepened`); a budget falls with the
        deadline. So each pool's estimate over the group lies in [estimate at the low ends, at the high
        ends]. When every pool is definitely feasible or definitely out (unhealthy, saturated, too slow)
        over the whole range, and the chosen pool's worst estimate beats every rival's best (ties as
        :meth:`decide` breaks them, by config order), :meth:`decide` picks that pool, tier and reason at
        every point of the range. Anything less certain is :class:`Unproven`: ``SCORES`` when the group's
        scores lie on both sides of a tier threshold or in two size buckets (its parts of one size each may
        still be decided as one), ``POOLS`` when the pools' estimates leave it open (the caller decides
        request by request).
        ``score`` and ``est_latency_s`` of the result are the group's highest.
        """
        plan = self._plan(low)
        score_lo, bucket = self._estimator.score(low, plan.cost_factor)
        score_hi, bucket_hi = self._estimator.score(high, plan.cost_factor)
        if bucket_hi != bucket:
            return Unproven.SCORES
        rank = _rank(score_lo, plan)
        if _rank(score_hi, plan) != rank:
            return Unproven.SCORES
        if plan.empty_reason is not None:
            return Decision(plan.remote_tier[rank], None, plan.empty_reason, score_hi, None, bucket)
        tight, loose = low.remaining_deadline_s, high.remaining_deadline_s
        if (tight is None) != (loose is None):
            return Unproven.POOLS
        budget_tight = budget_loose = math.inf
        if tight is not None and loose is not None:
            budget_tight, budget_loose = tight - self._slack, loose - self._slack
            if budget_loose <= 0.0:
                return Decision(plan.remote_tier[rank], None, Reason.REJECT_DEADLINE, score_hi, None, bucket)
            if budget_tight <= 0.0:
                return Unproven.POOLS
        service_lo = self._estimator.service_time(low, score_lo, bucket)
        service_hi = self._estimator.service_time(high, score_hi, bucket)
        left: Reason | None = None
        any_slow = any_saturated = False
        for tier, pools in plan.order[rank]:
            over = _over_range(
                pools,
                signals,
                depth_high,
                (service_lo, service_hi),
                (budget_tight, budget_loose),
                low.priority,
            )
            if over is None:
                return Unproven.POOLS
            feasible, slow, saturated = over
            if feasible:
                chosen = _always_best(feasible)
                if chosen is None:
                    return Unproven.POOLS
                pool, _, est_hi = chosen
                return Decision(tier, pool.name, left or plan.base_reason, score_hi, est_hi, bucket)
            if left is None:
                left = _left_because(slow, saturated)
            any_slow = any_slow or slow
            any_saturated = any_saturated or saturated
        reject = _rejected_because(any_slow, any_saturated)
        return Decision(plan.remote_tier[rank], None, reject, score_hi, None, bucket)

    def estimate_latency(self, profile: RequestProfile, pool: str, signals: PoolSignals) -> float:
        """Estimated finish time of the request on the named pool, as :meth:`decide` computes it."""
        spec = self._pools[pool]
        score, bucket = self._estimator.score(profile, self._plan(profile).cost_factor)
        return pool_latency(
            spec, signals, self._estimator.service_time(profile, score, bucket), profile.priority
        )

    def routes_to(self, pool: str) -> bool:
        """Whether ``pool`` is one of this policy's pools (a decision of an older policy may name one
        that a reload removed)."""
        return pool in self._pools

    def observe(self, model: str, decision: Decision, latency_s: float) -> None:
        """Feed back the service time (queue wait excluded) the decision's pool took for ``model``.

        The latency is scaled to a speed-1.0 pool before the calibrator sees it.
        """
        if decision.pool is None:
            raise ValueError("only a decision that named a pool can be observed")
        self.calibrator.observe(model, decision.size_bucket, latency_s * self._pools[decision.pool].speed)


def _rank(score: float, plan: RoutePlan) -> int:
    thresholds = plan.thresholds
    if score < thresholds.edge_server:
        return Tier.EDGE_DEVICE.rank
    if score < thresholds.cloud:
        return Tier.EDGE_SERVER.rank
    return Tier.CLOUD.rank


def _left_because(slow: bool, saturated: bool) -> Reason:
    """Why a tier with no pool to take the request was left: a pool too slow for the deadline, else one
    at its queue limit, else none healthy."""
    if slow:
        return Reason.DEADLINE
    return Reason.SPILLOVER_SATURATED if saturated else Reason.SPILLOVER_UNHEALTHY


def _rejected_because(any_slow: bool, any_saturated: bool) -> Reason:
    """Why no tier took the request: :func:`_left_because`'s order, as a rejection."""
    if any_slow:
        return Reason.REJECT_DEADLINE
    return Reason.REJECT_OVERLOADED if any_saturated else Reason.REJECT_UNAVAILABLE


def _over_range(
    pools: tuple[PoolSpec, ...],
    signals: Mapping[str, PoolSignals],
    depth_high: Mapping[str, int],
    service: tuple[float, float],
    budget: tuple[float, float],
    priority: Priority,
) -> tuple[list[tuple[PoolSpec, float, float]], bool, bool] | None:
    """A tier's pools over a group's range (service time low..high, budget tight..loose, each pool's
    depth from its signals' to ``depth_high``; the group's class ``priority``): the definitely feasible
    ones with their estimate ranges,
    whether one is definitely too slow, whether one is definitely saturated; None when a pool is
    feasible at some points of the range and not at others."""
    feasible: list[tuple[PoolSpec, float, float]] = []
    slow = saturated = False
    for pool in pools:
        sig = signals.get(pool.name)
        if sig is None or not sig.healthy:
            continue
        deepest = depth_high.get(pool.name, sig.queue_depth)
        if sig.queue_depth >= pool.max_queue_depth:
            saturated = True
            continue
        if deepest >= pool.max_queue_depth:
            return None
        est_lo = pool_latency(pool, sig, service[0], priority)
        est_hi = pool_latency(pool, sig.deepened(deepest), service[1], priority)
        if est_lo > budget[1]:
            slow = True
        elif est_hi <= budget[0]:
            feasible.append((pool, est_lo, est_hi))
        else:
            return None
    return feasible, slow, saturated


def _always_best(
    feasible: list[tuple[PoolSpec, float, float]],
) -> tuple[PoolSpec, float, float] | None:
    """The pool :meth:`TierPolicy.decide` picks among ``feasible`` (config order; estimate ranges) at every
    point of the ranges: its worst estimate below the best of each pool before it (an equal estimate keeps
    the earlier pool) and not above the best of each pool after it. None when no pool always wins."""
    for i, (_, _, worst) in enumerate(feasible):
        if all(worst < best for _, best, _ in feasible[:i]) and all(
            worst <= best for _, best, _ in feasible[i + 1 :]
        ):
            return feasible[i]
    return None
