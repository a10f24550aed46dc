"""The bounded set of regions a request can be attributed to, and how a location maps onto it.

Region names are metric labels and keys of per-region policy overrides, so the set is fixed here; anything
that cannot be placed is :data:`UNKNOWN_REGION`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

RegionName = Literal[
    "ap-southeast-1",
    "ap-northeast-1",
    "us-west",
    "us-east",
    "eu-central",
    "eu-west",
    "unknown",
]
"""Every region label routing ever produces, ``unknown`` included."""

UNKNOWN_REGION: Final = "unknown"


@dataclass(frozen=True, slots=True)
class Region:
    """One built-in region: its label and the continent code (as in MaxMind records) it lies on."""

    name: str
    continent: str
    description: str


REGIONS: Final[tuple[Region, ...]] = (
    Region("ap-southeast-1", "AS", "Singapore and South-East / South Asia"),
    Region("ap-northeast-1", "AS", "Tokyo and North-East Asia"),
    Region("us-west", "NA", "US West coast"),
    Region("us-east", "NA", "US East coast, Canada, Latin America"),
    Region("eu-central", "EU", "Frankfurt and central / eastern Europe"),
    Region("eu-west", "EU", "Ireland, UK, France, Iberia, Benelux"),
)
"""Built-in regions in display order."""

REGION_NAMES: Final[frozenset[str]] = frozenset(get_args(RegionName))
"""All valid region labels, ``unknown`` included."""

_NORTHEAST_ASIA: Final = frozenset({"JP", "KR", "KP", "TW", "HK", "MO", "CN", "MN"})
_WESTERN_EUROPE: Final = frozenset({"IE", "GB", "FR", "ES", "PT", "BE", "NL", "LU", "IS", "AD", "MC", "GI"})
# US states and Canadian provinces served from us-west; the rest of North America is us-east.
_NA_WEST_SUBDIVISIONS: Final = frozenset(
    {"WA", "OR", "CA", "NV", "ID", "MT", "WY", "UT", "CO", "AZ", "NM", "AK", "HI", "BC", "AB", "YT"}
)
_NA_WEST_LONGITUDE: Final = -100.0
_NORTH_AMERICA: Final = frozenset({"US", "CA", "MX"})
# Continents without a region of their own go to the region their traffic usually peers with.
_CONTINENT_DEFAULT: Final[dict[str, str]] = {
    "AS": "ap-southeast-1",
    "OC": "ap-southeast-1",
    "NA": "us-east",
    "SA": "us-east",
    "EU": "eu-central",
    "AF": "eu-central",
}


def region_for_location(
    continent: str | None,
    country: str | None,
    subdivision: str | None = None,
    longitude: float | None = None,
) -> str:
    """Map a location (continent and ISO country code, optionally state and longitude) to a region label.

    Returns :data:`UNKNOWN_REGION` when neither the country nor the continent is known.
    """
    if country in _NORTHEAST_ASIA:
        region = "ap-northeast-1"
    elif country in _WESTERN_EUROPE:
        region = "eu-west"
    elif continent == "NA" or country in _NORTH_AMERICA:
        west = subdivision in _NA_WEST_SUBDIVISIONS or (
            longitude is not None and longitude <= _NA_WEST_LONGITUDE
        )
        region = "us-west" if west else "us-east"
    elif continent is None:
        region = UNKNOWN_REGION
    else:
        region = _CONTINENT_DEFAULT.get(continent, UNKNOWN_REGION)
    return region
