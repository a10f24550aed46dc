"""The built-in region list and the location -> region map."""

from __future__ import annotations

import pytest

from routing import REGION_NAMES, REGIONS, UNKNOWN_REGION
from routing.regions import region_for_location


def test_region_list_and_continents() -> None:
    """Six built-in regions on the continents the deployment covers."""
    assert [(r.name, r.continent) for r in REGIONS] == [
        ("ap-southeast-1", "AS"),
        ("ap-northeast-1", "AS"),
        ("us-west", "NA"),
        ("us-east", "NA"),
        ("eu-central", "EU"),
        ("eu-west", "EU"),
    ]


def test_label_set_is_regions_plus_unknown() -> None:
    """Region labels are exactly the built-in names and unknown."""
    assert {r.name for r in REGIONS} | {UNKNOWN_REGION} == REGION_NAMES


@pytest.mark.parametrize(
    ("continent", "country", "subdivision", "longitude", "region"),
    [
        ("AS", "SG", None, None, "ap-southeast-1"),
        ("AS", "IN", None, None, "ap-southeast-1"),
        ("AS", "JP", None, None, "ap-northeast-1"),
        ("AS", "KR", None, None, "ap-northeast-1"),
        ("NA", "US", "CA", None, "us-west"),
        ("NA", "US", None, -122.4, "us-west"),
        ("NA", "US", "NY", -74.0, "us-east"),
        ("NA", "US", None, None, "us-east"),
        ("EU", "DE", None, None, "eu-central"),
        ("EU", "FR", None, None, "eu-west"),
        ("EU", "GB", None, None, "eu-west"),
        ("OC", "AU", None, None, "ap-southeast-1"),
        ("SA", "BR", None, None, "us-east"),
        ("AF", "ZA", None, None, "eu-central"),
        (None, "JP", None, None, "ap-northeast-1"),
        (None, None, None, None, "unknown"),
        ("AN", "AQ", None, None, "unknown"),
    ],
)
def test_location_maps_to_region(
    continent: str | None, country: str | None, subdivision: str | None, longitude: float | None, region: str
) -> None:
    """A location maps to the region its traffic is served from, or unknown."""
    assert region_for_location(continent, country, subdivision, longitude) == region
