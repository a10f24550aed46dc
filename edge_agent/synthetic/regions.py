"""Per-region shape of the synthetic traffic: how much of it, which languages, which devices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class RegionProfile:
    """What a region's shoppers look like to the recommender and search models."""

    name: str
    share: float  # share of global requests
    locales: tuple[tuple[str, float], ...]  # (BCP 47 locale, weight)
    currency: str
    devices: tuple[tuple[str, float], ...]
    ship_days: tuple[int, int]  # typical delivery range from Hong Kong, days


PROFILES: Final[tuple[RegionProfile, ...]] = (
    RegionProfile(
        "ap-southeast-1",
        0.22,
        (("en-SG", 0.35), ("zh-SG", 0.2), ("id-ID", 0.3), ("th-TH", 0.15)),
        "SGD",
        (("android", 0.62), ("ios", 0.28), ("web", 0.10)),
        (3, 7),
    ),
    RegionProfile(
        "ap-northeast-1",
        0.18,
        (("ja-JP", 0.7), ("ko-KR", 0.2), ("en-US", 0.1)),
        "JPY",
        (("ios", 0.58), ("android", 0.32), ("web", 0.10)),
        (2, 5),
    ),
    RegionProfile(
        "us-west",
        0.17,
        (("en-US", 0.82), ("zh-CN", 0.12), ("ko-KR", 0.06)),
        "USD",
        (("ios", 0.55), ("android", 0.25), ("web", 0.20)),
        (6, 12),
    ),
    RegionProfile(
        "us-east",
        0.18,
        (("en-US", 0.9), ("zh-CN", 0.05), ("fr-CA", 0.05)),
        "USD",
        (("ios", 0.52), ("android", 0.26), ("web", 0.22)),
        (7, 14),
    ),
    RegionProfile(
        "eu-central",
        0.13,
        (("de-DE", 0.75), ("en-GB", 0.15), ("fr-FR", 0.10)),
        "EUR",
        (("android", 0.48), ("ios", 0.32), ("web", 0.20)),
        (7, 15),
    ),
    RegionProfile(
        "eu-west",
        0.12,
        (("en-GB", 0.45), ("fr-FR", 0.40), ("de-DE", 0.15)),
        "EUR",
        (("ios", 0.45), ("android", 0.35), ("web", 0.20)),
        (6, 14),
    ),
)
PROFILE_BY_NAME: Final = {p.name: p for p in PROFILES}
