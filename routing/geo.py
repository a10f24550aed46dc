"""Region of a request: from the agent's identity, else from the peer address through a MaxMind database.

The caller opens the database (``geoip2.database.Reader(path)``, path from ``routing.geoip_db``) and
hands the reader in; reading a record is an in-memory lookup. Every answer is one of
:data:`routing.regions.REGION_NAMES`, so it is safe as a metric label.

geoip2 is imported only with a reader in hand (which only a host that has it can make), so importing
``routing`` needs no geoip2: an edge agent, which resolves no addresses, does not install it.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Literal

from routing.regions import REGION_NAMES, UNKNOWN_REGION, region_for_location

if TYPE_CHECKING:
    import geoip2.database

_Lookup = Literal["city", "country", "enterprise"]


def peer_host(address: str) -> str:
    """The host part of a peer address: ``1.2.3.4``, ``1.2.3.4:5555``, ``[::1]:5555``, ``tcp://...``."""
    host = address.strip()
    if "://" in host:
        host = host.split("://", 1)[1]
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


class RegionResolver:
    """Resolves the region label of a request.

    The agent's identity wins when it names a known region (the gateway has authenticated the agent, so
    its configured region is trusted); otherwise the peer address is looked up in the database, if any.
    Private, loopback and unparsable addresses and addresses missing from the database are ``unknown``.
    """

    __slots__ = ("_lookup", "_not_found", "_reader")

    def __init__(self, reader: geoip2.database.Reader | None = None) -> None:
        self._reader = reader
        self._lookup: _Lookup = "country"
        self._not_found: tuple[type[Exception], ...] = ()
        if reader is not None:
            import geoip2.errors

            self._not_found = (geoip2.errors.AddressNotFoundError,)
            db_type = reader.metadata().database_type
            if "Enterprise" in db_type:
                self._lookup = "enterprise"
            elif "City" in db_type:
                self._lookup = "city"
            elif "Country" not in db_type:
                raise ValueError(f"{db_type!r} is not a MaxMind country, city or enterprise database")

    def resolve(self, agent_region: str = "", peer_address: str | None = None) -> str:
        """The region of a request from the agent configured for ``agent_region`` at ``peer_address``."""
        if agent_region in REGION_NAMES and agent_region != UNKNOWN_REGION:
            return agent_region
        if peer_address is None:
            return UNKNOWN_REGION
        return self.region_of_address(peer_address)

    def region_of_address(self, peer_address: str) -> str:
        """The region of a peer address alone (see :func:`peer_host` for the accepted forms)."""
        if self._reader is None:
            return UNKNOWN_REGION
        try:
            ip = ipaddress.ip_address(peer_host(peer_address))
        except ValueError:
            return UNKNOWN_REGION
        if not ip.is_global:
            return UNKNOWN_REGION
        try:
            if self._lookup == "country":
                rec = self._reader.country(ip)
                return region_for_location(
                    rec.continent.code, rec.country.iso_code or rec.registered_country.iso_code
                )
            city = self._reader.city(ip) if self._lookup == "city" else self._reader.enterprise(ip)
        except self._not_found:
            return UNKNOWN_REGION
        return region_for_location(
            city.continent.code,
            city.country.iso_code or city.registered_country.iso_code,
            city.subdivisions.most_specific.iso_code,
            city.location.longitude,
        )
