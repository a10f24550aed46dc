"""Values the routing policy takes and returns.

Everything here is a plain value: enums that double as metric labels, and frozen slotted dataclasses that
the gateway and the edge agent build from a wire request without routing having to know protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from routing.regions import UNKNOWN_REGION


class Tier(StrEnum):
    """Where a request is served, ordered from the caller outwards by :attr:`rank`."""

    EDGE_DEVICE = "edge_device"
    EDGE_SERVER = "edge_server"
    CLOUD = "cloud"

    @property
    def rank(self) -> int:
        """Position from the caller outwards: 0 = edge device, 2 = cloud."""
        return _TIER_RANK[self]


_TIER_RANK: dict[Tier, int] = {Tier.EDGE_DEVICE: 0, Tier.EDGE_SERVER: 1, Tier.CLOUD: 2}

TIERS_BY_RANK: tuple[Tier, ...] = (Tier.EDGE_DEVICE, Tier.EDGE_SERVER, Tier.CLOUD)
"""All tiers, lowest rank first."""


class Priority(StrEnum):
    """Priority class of a request; mirrors the wire's ``PriorityClass`` (UNSPECIFIED = INTERACTIVE)."""

    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BATCH = "batch"


class RequestKind(StrEnum):
    """What a request carries; selects the complexity estimator."""

    RANKING = "ranking"
    TEXT = "text"
    IMAGE = "image"
    TENSOR = "tensor"


class Reason(StrEnum):
    """Why a decision came out as it did. A bounded set: it is a metric label."""

    COMPLEXITY = "complexity"
    """Served on the tier the complexity score selects (the nearest tier that serves the model)."""
    MODEL_PINNED = "model_pinned"
    """The model (or model version) is pinned to a tier or pool by config."""
    SPILLOVER_SATURATED = "spillover_saturated"
    """The score's tier had its pools at their queue limit; served on another tier."""
    SPILLOVER_UNHEALTHY = "spillover_unhealthy"
    """The score's tier had no healthy pool; served on another tier."""
    DEADLINE = "deadline"
    """The score's tier could not finish before the deadline; served on a tier that can."""
    REJECT_OVERLOADED = "reject_overloaded"
    """Every pool that could serve the request is at its queue limit."""
    REJECT_UNAVAILABLE = "reject_unavailable"
    """Every pool that could serve the request is unhealthy or reports no signals."""
    REJECT_DEADLINE = "reject_deadline"
    """No pool can finish before the deadline (or the deadline has already passed)."""
    REJECT_NO_MODEL = "reject_no_model"
    """No pool serves the model."""
    REJECT_NO_POOL = "reject_no_pool"
    """Pools serve the model, but none takes this priority class in this region."""


REJECT_REASONS: frozenset[Reason] = frozenset(
    {
        Reason.REJECT_OVERLOADED,
        Reason.REJECT_UNAVAILABLE,
        Reason.REJECT_DEADLINE,
        Reason.REJECT_NO_MODEL,
        Reason.REJECT_NO_POOL,
    }
)
"""Reasons that mean nothing will serve the request."""

SPILLOVER_REASONS: frozenset[Reason] = frozenset(
    {Reason.SPILLOVER_SATURATED, Reason.SPILLOVER_UNHEALTHY, Reason.DEADLINE}
)
"""Reasons under which a request may land on a tier other than its score's tier."""


@dataclass(frozen=True, slots=True)
class RequestProfile:
    """What routing needs to know about one request, extracted by the caller from the wire message.

    Only the size fields of the request's ``kind`` are read: ``candidates`` x ``feature_width`` for
    ranking, ``text_tokens`` (or ``text_chars`` when no token count is known) for text, ``pixels`` for
    images and ``tensor_elements`` for generic tensors.
    """

    kind: RequestKind
    model: str
    model_version: str = ""
    """Empty means the serving default."""
    priority: Priority = Priority.INTERACTIVE
    remaining_deadline_s: float | None = None
    """Seconds left until the request's deadline as the caller measured it; None = no deadline."""
    candidates: int = 0
    feature_width: int = 0
    text_chars: int = 0
    text_tokens: int = 0
    """Exact token count when the caller has one; 0 = estimate from ``text_chars``."""
    pixels: int = 0
    tensor_elements: int = 0
    client_hint: float = 0.0
    """Client's complexity estimate in [0, 1]; 0 = none. It can only raise the score."""
    region: str = UNKNOWN_REGION


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """Live state of one backend pool, as the caller last observed it."""

    queue_depth: int = 0
    """Requests (or batches) waiting for the pool, not counting those in service."""
    ewma_latency_s: float = 0.0
    """Recent service time per queued item; 0 = not known yet (the cost model's estimate is used)."""
    healthy: bool = True
    concurrency: int = 0
    """Items the pool serves at once right now; 0 = the pool's configured concurrency."""
    urgent_depth: tuple[int, int] | None = None
    """Of ``queue_depth``, the realtime requests, and the realtime and interactive ones together: a pool
    that serves its queue by class, realtime first, then interactive, then batch (the gateway's lanes), has
    a request wait behind those as urgent as it or more only. None: not known, or a pool that serves first
    come first served; every class waits behind the whole queue."""

    def waiting_for(self, priority: Priority) -> int:
        """How many queued requests a request of ``priority`` waits behind."""
        urgent = self.urgent_depth
        if urgent is None or priority is Priority.BATCH:
            return self.queue_depth
        return urgent[0] if priority is Priority.REALTIME else urgent[1]

    def joined(self, priority: Priority, n: int = 1) -> PoolSignals:
        """These signals once ``n`` more requests of ``priority`` are queued."""
        urgent = self.urgent_depth
        if urgent is not None and priority is not Priority.BATCH:
            urgent = (
                (urgent[0] + n, urgent[1] + n)
                if priority is Priority.REALTIME
                else (urgent[0], urgent[1] + n)
            )
        return PoolSignals(self.queue_depth + n, self.ewma_latency_s, self.healthy, self.concurrency, urgent)

    def deepened(self, depth: int) -> PoolSignals:
        """These signals with the queue ``depth`` deep, every class's wait grown by as much (an upper bound:
        :meth:`routing.TierPolicy.decide_range`'s deepest queue a frame can make)."""
        extra = depth - self.queue_depth
        if extra == 0:
            return self
        urgent = self.urgent_depth
        if urgent is not None:
            urgent = (urgent[0] + extra, urgent[1] + extra)
        return PoolSignals(depth, self.ewma_latency_s, self.healthy, self.concurrency, urgent)


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and why.

    ``tier`` is set even on a rejection: it is the tier the score selected, for metrics.
    """

    tier: Tier
    pool: str | None
    reason: Reason
    score: float
    est_latency_s: float | None = None
    """Estimated queue wait plus service time on ``pool``; None when no pool was chosen."""
    size_bucket: int = 0
    """Size bucket of the request, the key the caller feeds back to calibration."""

    @property
    def rejected(self) -> bool:
        """True when nothing will serve the request."""
        return self.reason in REJECT_REASONS
