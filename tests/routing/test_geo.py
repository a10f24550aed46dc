"""RegionResolver against real .mmdb files written by the tests with mmdb-writer (no network)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import geoip2.database
import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from routing import RegionResolver
from routing.geo import peer_host

COUNTRIES: dict[str, tuple[str, str]] = {
    "1.0.16.0/24": ("AS", "JP"),
    "8.8.4.0/24": ("AS", "SG"),
    "5.9.0.0/16": ("EU", "DE"),
    "2.0.0.0/16": ("EU", "FR"),
    "3.3.3.0/24": ("NA", "US"),
    "2001:200::/32": ("AS", "JP"),
}
CITIES: dict[str, tuple[str, str, str, float]] = {
    "13.52.0.0/16": ("NA", "US", "CA", -122.4),
    "3.80.0.0/16": ("NA", "US", "VA", -77.5),
    "15.222.0.0/16": ("NA", "CA", "ON", -79.4),
}


def country_record(continent: str, country: str) -> dict[str, Any]:
    """A GeoLite2-Country style record."""
    return {
        "continent": {"code": continent, "names": {"en": continent}},
        "country": {"iso_code": country, "names": {"en": country}},
    }


def write_db(path: Path, database_type: str, records: dict[str, dict[str, Any]]) -> Path:
    """Write an IPv6 (IPv4-compatible) MaxMind database of ``records`` keyed by network."""
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type=database_type, languages=["en"])
    for network, record in records.items():
        writer.insert_network(IPSet([network]), record)
    writer.to_db_file(str(path))
    return path


@pytest.fixture(scope="module")
def country_reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[geoip2.database.Reader]:
    """A reader over a country database the test wrote."""
    records = {net: country_record(*loc) for net, loc in COUNTRIES.items()}
    path = write_db(tmp_path_factory.mktemp("geo") / "country.mmdb", "GeoLite2-Country", records)
    with geoip2.database.Reader(str(path)) as reader:
        yield reader


@pytest.fixture(scope="module")
def city_reader(tmp_path_factory: pytest.TempPathFactory) -> Iterator[geoip2.database.Reader]:
    """A reader over a city database (with subdivisions and longitude) the test wrote."""
    records = {
        net: {
            **country_record(continent, country),
            "subdivisions": [{"iso_code": sub, "names": {"en": sub}}],
            "location": {"latitude": 40.0, "longitude": lon},
        }
        for net, (continent, country, sub, lon) in CITIES.items()
    }
    path = write_db(tmp_path_factory.mktemp("geo") / "city.mmdb", "GeoLite2-City", records)
    with geoip2.database.Reader(str(path)) as reader:
        yield reader


@pytest.mark.parametrize(
    ("address", "region"),
    [
        ("1.0.16.1", "ap-northeast-1"),
        ("8.8.4.4", "ap-southeast-1"),
        ("5.9.10.11", "eu-central"),
        ("2.0.1.2", "eu-west"),
        ("3.3.3.3", "us-east"),
        ("2001:200::1", "ap-northeast-1"),
    ],
)
def test_country_db_maps_address(country_reader: geoip2.database.Reader, address: str, region: str) -> None:
    """A peer address in the country database resolves to its country's region."""
    assert RegionResolver(country_reader).resolve("", address) == region


@pytest.mark.parametrize(
    ("address", "region"),
    [("13.52.1.1", "us-west"), ("3.80.1.1", "us-east"), ("15.222.1.1", "us-east")],
)
def test_city_db_splits_north_america(city_reader: geoip2.database.Reader, address: str, region: str) -> None:
    """A city database places US and Canadian peers east or west by state and longitude."""
    assert RegionResolver(city_reader).resolve("", address) == region


@pytest.mark.parametrize(
    "address",
    ["9.9.9.9", "not-an-ip", "10.1.2.3", "127.0.0.1", "::1", ""],
    ids=["absent", "garbage", "private", "loopback", "loopback6", "empty"],
)
def test_unknown_addresses(country_reader: geoip2.database.Reader, address: str) -> None:
    """Addresses missing from the database, private, loopback or unparsable resolve to unknown."""
    assert RegionResolver(country_reader).resolve("", address) == "unknown"


def test_agent_identity_wins(country_reader: geoip2.database.Reader) -> None:
    """An agent configured for a known region is attributed to it whatever its address."""
    assert RegionResolver(country_reader).resolve("us-west", "1.0.16.1") == "us-west"


def test_unknown_agent_region_falls_back_to_address(country_reader: geoip2.database.Reader) -> None:
    """An agent region outside the built-in set is ignored in favour of the address."""
    assert RegionResolver(country_reader).resolve("mars-1", "1.0.16.1") == "ap-northeast-1"


def test_no_database_gives_unknown() -> None:
    """Without a database only the agent identity can place a request."""
    resolver = RegionResolver()
    assert (resolver.resolve("", "1.0.16.1"), resolver.resolve("eu-west", None)) == ("unknown", "eu-west")


def test_peer_address_with_port(country_reader: geoip2.database.Reader) -> None:
    """Peer addresses with ports and ZeroMQ-style schemes are looked up by their host."""
    resolver = RegionResolver(country_reader)
    assert resolver.region_of_address("tcp://1.0.16.1:5555") == "ap-northeast-1"
    assert resolver.region_of_address("[2001:200::1]:5555") == "ap-northeast-1"


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("1.2.3.4", "1.2.3.4"),
        ("1.2.3.4:80", "1.2.3.4"),
        ("[::1]:80", "::1"),
        ("tcp://[::1]:5", "::1"),
        ("::1", "::1"),
    ],
)
def test_peer_host(address: str, host: str) -> None:
    """peer_host strips scheme, brackets and port."""
    assert peer_host(address) == host


def test_non_geo_database_is_refused(tmp_path: Path) -> None:
    """A database that is neither country, city nor enterprise is refused when the resolver is built."""
    path = write_db(tmp_path / "asn.mmdb", "GeoLite2-ASN", {"1.0.0.0/24": {"autonomous_system_number": 1}})
    with geoip2.database.Reader(str(path)) as reader, pytest.raises(ValueError, match="GeoLite2-ASN"):
        RegionResolver(reader)
