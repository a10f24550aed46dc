"""Routing policy of hk-edge-gateway: request profile and live pool signals in, a decision out.

Pure policy: no I/O, no clock it is not given, no logging. The gateway calls
:meth:`TierPolicy.decide`; the edge agent calls :meth:`TierPolicy.tier_for`.
"""

from routing.calibration import LatencyCalibrator, LatencyEstimate
from routing.complexity import ComplexityEstimator
from routing.config import (
    RoutingConfig,
    RoutingConfigError,
    default_routing_config,
    load_routing_config,
)
from routing.geo import RegionResolver
from routing.holder import PolicyHolder
from routing.policy import TierPolicy, Unproven
from routing.regions import REGION_NAMES, REGIONS, UNKNOWN_REGION, Region
from routing.types import (
    REJECT_REASONS,
    Decision,
    PoolSignals,
    Priority,
    Reason,
    RequestKind,
    RequestProfile,
    Tier,
)

__all__ = [
    "REGIONS",
    "REGION_NAMES",
    "REJECT_REASONS",
    "UNKNOWN_REGION",
    "ComplexityEstimator",
    "Decision",
    "LatencyCalibrator",
    "LatencyEstimate",
    "PolicyHolder",
    "PoolSignals",
    "Priority",
    "Reason",
    "Region",
    "RegionResolver",
    "RequestKind",
    "RequestProfile",
    "RoutingConfig",
    "RoutingConfigError",
    "Tier",
    "TierPolicy",
    "Unproven",
    "default_routing_config",
    "load_routing_config",
]
