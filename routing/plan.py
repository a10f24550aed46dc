"""Static part of a routing decision: which pools may serve a (model, version, priority, region), by tier.

A :class:`RoutePlan` depends only on config, so the policy builds each once and caches it; per request only
the score and the live pool signals remain to be looked at.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.config import PoolConfig, RoutingConfig, Thresholds
from routing.types import TIERS_BY_RANK, Priority, Reason, Tier


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A configured pool, reduced to what the hot path reads."""

    name: str
    tier: Tier
    speed: float
    concurrency: int
    max_queue_depth: int

    @classmethod
    def of(cls, pool: PoolConfig) -> PoolSpec:
        """The spec of a configured pool."""
        return cls(pool.name, pool.tier, pool.speed, pool.concurrency, pool.max_queue_depth)


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """Candidate pools of one (model, version, priority, region) and the order tiers are tried in.

    ``order[r]`` is the try order for a request whose score selects the tier of rank ``r``: the nearest
    tier at or above it that has pools first (so the score's tier for reasons), then the tiers above it,
    then (if spilling down is allowed) those below, nearest first. ``remote_tier[r]`` is the first of
    them; ``agent_tier[r]`` is the same choice with the edge device counted as a tier.
    """

    thresholds: Thresholds
    cost_factor: float
    base_reason: Reason
    """COMPLEXITY, or MODEL_PINNED when a pin restricts the candidates."""
    order: tuple[tuple[tuple[Tier, tuple[PoolSpec, ...]], ...], ...]
    remote_tier: tuple[Tier, ...]
    agent_tier: tuple[Tier | None, ...]
    empty_reason: Reason | None
    """Why the plan has no pool at all (REJECT_NO_MODEL or REJECT_NO_POOL); None when it has some."""


def _nearest(available: list[Tier], rank: int) -> Tier | None:
    """The lowest available tier at or above ``rank``, else the highest available one."""
    if not available:
        return None
    for tier in available:
        if tier.rank >= rank:
            return tier
    return available[-1]


def build_plan(config: RoutingConfig, model: str, version: str, priority: Priority, region: str) -> RoutePlan:
    """The plan for requests to ``model`` (at ``version``) of class ``priority`` from ``region``.

    Pins (a version pin, then ``pin_pool``) name the only pool and bypass the priority and region filters:
    they say where the model runs. ``pin_tier`` keeps the filters but allows only that tier.
    """
    model_cfg = config.models.get(model)
    override = {str(name): o for name, o in config.regions.items()}.get(region)
    thresholds = config.thresholds
    if model_cfg is not None and model_cfg.thresholds is not None:
        thresholds = model_cfg.thresholds
    if override is not None and override.thresholds is not None:
        thresholds = override.thresholds

    pools: list[PoolConfig] = []
    base_reason = Reason.COMPLEXITY
    on_device = model_cfg is not None and model_cfg.on_device
    if model_cfg is not None:
        pin = model_cfg.version_pins.get(version) if version else None
        pin = pin or model_cfg.pin_pool
        if pin is not None:
            pools = [p for p in config.pools if p.name == pin]
            base_reason = Reason.MODEL_PINNED
            on_device = False
        else:
            allowed = None if override is None or override.pools is None else set(override.pools)
            pools = [
                p
                for p in config.pools
                if model in p.models and priority in p.priorities and (allowed is None or p.name in allowed)
            ]
            if model_cfg.pin_tier is not None:
                pools = [p for p in pools if p.tier is model_cfg.pin_tier]
                on_device = on_device and model_cfg.pin_tier is Tier.EDGE_DEVICE
                base_reason = Reason.MODEL_PINNED

    by_tier: dict[Tier, tuple[PoolSpec, ...]] = {}
    for tier in TIERS_BY_RANK:
        specs = tuple(PoolSpec.of(p) for p in pools if p.tier is tier)
        if specs:
            by_tier[tier] = specs
    available = [t for t in TIERS_BY_RANK if t in by_tier]
    with_device = ([Tier.EDGE_DEVICE] if on_device else []) + available

    order: list[tuple[tuple[Tier, tuple[PoolSpec, ...]], ...]] = []
    remote_tier: list[Tier] = []
    agent_tier: list[Tier | None] = []
    for rank in range(len(TIERS_BY_RANK)):
        first = _nearest(available, rank)
        agent_tier.append(_nearest(with_device, rank))
        if first is None:
            order.append(())
            remote_tier.append(TIERS_BY_RANK[max(rank, 1)])
            continue
        above = [t for t in available if t.rank > first.rank]
        below = [t for t in reversed(available) if t.rank < first.rank] if config.spill_down else []
        order.append(tuple((t, by_tier[t]) for t in [first, *above, *below]))
        remote_tier.append(first)

    empty_reason = None
    if not available:
        served = model_cfg is not None and any(model in p.models for p in config.pools)
        empty_reason = Reason.REJECT_NO_POOL if served else Reason.REJECT_NO_MODEL
    return RoutePlan(
        thresholds=thresholds,
        cost_factor=model_cfg.cost_factor if model_cfg is not None else 1.0,
        base_reason=base_reason,
        order=tuple(order),
        remote_tier=tuple(remote_tier),
        agent_tier=tuple(agent_tier),
        empty_reason=empty_reason,
    )
