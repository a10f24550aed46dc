"""Realistic synthetic traffic for the demo, the tests and the benchmarks (deterministic under a seed)."""

from edge_agent.synthetic.regions import PROFILE_BY_NAME, PROFILES, RegionProfile
from edge_agent.synthetic.traffic import (
    MODEL_IMAGE,
    MODEL_RANKING,
    MODEL_TEXT,
    SyntheticRequest,
    SyntheticTraffic,
)

__all__ = [
    "MODEL_IMAGE",
    "MODEL_RANKING",
    "MODEL_TEXT",
    "PROFILES",
    "PROFILE_BY_NAME",
    "RegionProfile",
    "SyntheticRequest",
    "SyntheticTraffic",
]
