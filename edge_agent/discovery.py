"""Where the gateway's carrier ingresses are: DNS discovery of the uplink's DEALER endpoints.

The uplink connects one DEALER socket to every carrier endpoint. This module turns DNS into that list:
SRV records for the ingest name (one carrier per SRV target, in preference order), or the A/AAAA records
of a host name plus a configured port. An answer is kept for its TTL (clamped to ``[min_ttl_s,
max_ttl_s]``) and then asked for again. A DNS failure never raises: the last good answer is served
(source ``"cache"``) for a grace period after it expired, then the configured static list takes over
(source ``"static"``), and either way the failure comes back as a :class:`FailureReason` the caller can
count.

The ordering, naming and TTL rules are pure functions at the top of the module; only
:class:`GatewayDiscovery` talks to a name server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Literal

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rdtypes.IN.SRV
import dns.resolver
import dns.rrset

DiscoveryMode = Literal["srv", "address", "static"]
DiscoverySource = Literal["srv", "address", "static", "cache"]


class FailureReason(StrEnum):
    """Why a resolution failed; the value is the metric label and log field."""

    TIMEOUT = "timeout"
    NXDOMAIN = "nxdomain"
    NO_ANSWER = "no_answer"  # the name exists but has no records of the asked type
    NO_NAMESERVERS = "no_nameservers"  # every name server refused, failed or was unreachable
    NO_ENDPOINTS = "no_endpoints"  # records came back, but none gave a usable host and port
    DNS_ERROR = "dns_error"  # anything else dnspython or the socket layer reported


@dataclass(frozen=True)
class CarrierEndpoint:
    """One carrier ingress the uplink connects a DEALER socket to.

    ``name`` is a stable label the uplink keys its carriers by: the first label of the SRV target
    (``hgc`` for ``hgc.ingest.hk.example.``), the address itself in address mode, or the configured
    name of a static entry.
    """

    name: str
    endpoint: str  # "tcp://HOST:PORT", IPv6 hosts in brackets


@dataclass(frozen=True)
class Discovered:
    """The endpoint list one resolution produced, in preference order, and how long it is good for.

    ``source`` says where the list came from: a fresh SRV or address answer, the last good answer kept
    past its TTL because DNS failed (``"cache"``), or the configured static list. ``error`` and
    ``reason`` are set whenever DNS failed, even when a cached answer still covers for it.
    """

    endpoints: tuple[CarrierEndpoint, ...]
    ttl_s: float
    source: DiscoverySource
    error: str = ""
    reason: FailureReason | None = None


@dataclass(frozen=True)
class SrvRecord:
    """The fields of one SRV record that discovery uses; ``target`` is the name as text."""

    priority: int
    weight: int
    port: int
    target: str


def canonical_name(name: str) -> str:
    """``name`` lower-cased and absolute (trailing dot), the form addresses are looked up under."""
    lowered = name.lower()
    return lowered if lowered.endswith(".") else lowered + "."


def order_srv(records: Iterable[SrvRecord]) -> tuple[SrvRecord, ...]:
    """SRV records in preference order: priority ascending, then weight descending, then target, port.

    RFC 2782 picks among records of equal priority at random, weighted by ``weight``, because a client
    talks to one of them. The agent connects to every carrier and routes by measured RTT, so a random
    order would only make the carrier list (and the logs) differ between refreshes for no gain; the
    order here is deterministic and a permutation of the input gives the same result.
    """
    return tuple(
        sorted(
            set(records),
            key=lambda r: (r.priority, -r.weight, canonical_name(r.target), r.port, r.target),
        )
    )


def endpoint_url(host: str, port: int) -> str:
    """The ZeroMQ endpoint for ``host`` and ``port``; IPv6 literals are bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def srv_endpoints(
    records: Sequence[SrvRecord], addresses: Mapping[str, Sequence[str]]
) -> tuple[CarrierEndpoint, ...]:
    """Carrier endpoints for ordered SRV ``records``, given each target's addresses (A first, then AAAA).

    A carrier is an SRV target, so each target yields one endpoint, on its first address; a target of
    ``"."`` (RFC 2782: service not offered there) or one without addresses yields none. Names are the
    target's first label, made unique with the port (then the full name) if two records share it, since
    the uplink keys its carriers by name.
    """
    out: list[CarrierEndpoint] = []
    taken: set[str] = set()
    for record in records:
        target = canonical_name(record.target)
        found = addresses.get(target, ())
        if target == "." or not found:
            continue
        fqdn = target.rstrip(".")
        for name in (fqdn.split(".")[0], f"{fqdn.split('.')[0]}-{record.port}", f"{fqdn}-{record.port}"):
            if name not in taken:
                break
        else:
            continue  # the same target and port twice: one connection is enough
        taken.add(name)
        out.append(CarrierEndpoint(name, endpoint_url(found[0], record.port)))
    return tuple(out)


def address_endpoints(addresses: Iterable[str], port: int) -> tuple[CarrierEndpoint, ...]:
    """One carrier endpoint per address (in answer order, duplicates dropped), named by the address."""
    return tuple(CarrierEndpoint(a, endpoint_url(a, port)) for a in dict.fromkeys(addresses))


def clamp_ttl(ttls: Iterable[float], min_ttl_s: float, max_ttl_s: float) -> float:
    """The smallest of ``ttls``, clamped to ``[min_ttl_s, max_ttl_s]``; ``min_ttl_s`` when there are none."""
    smallest = min(ttls, default=min_ttl_s)
    return float(max(min_ttl_s, min(max_ttl_s, smallest)))


def degraded_answer(
    *,
    last_good: Discovered | None,
    good_until: float,
    now: float,
    grace_s: float,
    static: tuple[CarrierEndpoint, ...],
    retry_s: float,
    reason: FailureReason,
    error: str,
) -> Discovered:
    """What to serve when DNS failed at ``now``: the last good answer while within ``grace_s`` of its
    expiry ``good_until``, else the static list. Both are retried after ``retry_s`` (the cached one no
    later than the end of its grace)."""
    grace_end = good_until + grace_s
    if last_good is not None and now < grace_end:
        ttl = max(0.0, min(retry_s, grace_end - now))
        return Discovered(last_good.endpoints, ttl, "cache", error, reason)
    return Discovered(static, retry_s, "static", error, reason)


def parse_nameserver(text: str, default_port: int = 53) -> tuple[str, int]:
    """``"IP"``, ``"IP:PORT"`` or ``"[IPv6]:PORT"`` as ``(ip, port)``; raises ``ValueError`` otherwise."""
    host, port = text, default_port
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"not an address[:port]: {text!r}")
        if rest:
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {text!r}")
    return host, port


class _DiscoveryFailed(Exception):
    def __init__(self, reason: FailureReason, error: str) -> None:
        super().__init__(error)
        self.reason = reason
        self.error = error


def _classify(exc: Exception) -> FailureReason:
    if isinstance(exc, dns.resolver.NXDOMAIN):
        return FailureReason.NXDOMAIN
    if isinstance(exc, dns.resolver.NoAnswer):
        return FailureReason.NO_ANSWER
    if isinstance(exc, dns.exception.Timeout):
        return FailureReason.TIMEOUT
    if isinstance(exc, dns.resolver.NoNameservers):
        return FailureReason.NO_NAMESERVERS
    return FailureReason.DNS_ERROR


def _addresses_in(rrsets: Iterable[dns.rrset.RRset]) -> list[str]:
    return [
        str(rdata.address)
        for rrset in rrsets
        for rdata in rrset
        if isinstance(rdata, dns.rdtypes.IN.A.A | dns.rdtypes.IN.AAAA.AAAA)
    ]


class GatewayDiscovery:
    """Finds the gateway's carrier endpoints through DNS, honouring TTLs, never raising on DNS failure.

    ``mode`` ``"srv"`` asks for SRV records of ``name`` (e.g. ``_edgeinfer._tcp.ingest.hk.example.``) and
    the addresses of their targets (from the additional section when the server sent them, else by
    asking); ``"address"`` asks for the A and AAAA records of ``name`` and uses ``port``; ``"static"``
    never asks and serves ``static``. ``nameservers`` are ``(ip, port)`` pairs; empty means the system
    resolver configuration (``/etc/resolv.conf``). ``timeout_s`` bounds each DNS query. ``clock`` is
    monotonic seconds and only decides expiry; ``watch`` sleeps in real time.
    """

    def __init__(
        self,
        name: str = "",
        *,
        mode: DiscoveryMode = "srv",
        port: int | None = None,
        nameservers: Sequence[tuple[str, int]] = (),
        static: Sequence[CarrierEndpoint] = (),
        min_ttl_s: float = 1.0,
        max_ttl_s: float = 300.0,
        grace_s: float | None = None,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in ("srv", "address", "static"):
            raise ValueError(f"mode: must be 'srv', 'address' or 'static', not {mode!r}")
        if mode != "static" and not name:
            raise ValueError(f"name: mode {mode!r} needs a DNS name")
        if mode == "address" and (port is None or not 0 < port < 65536):
            raise ValueError("port: mode 'address' needs a port in 1..65535")
        if not 0 < min_ttl_s <= max_ttl_s:
            raise ValueError("min_ttl_s, max_ttl_s: need 0 < min_ttl_s <= max_ttl_s")
        if timeout_s <= 0:
            raise ValueError("timeout_s: must be positive")
        if grace_s is not None and grace_s < 0:
            raise ValueError("grace_s: must not be negative")
        for ip, ns_port in nameservers:
            ipaddress.ip_address(ip)
            if not 0 < ns_port < 65536:
                raise ValueError(f"nameservers: port out of range for {ip}")
        self.name = name
        self.mode: DiscoveryMode = mode
        self.port = port or 0
        self.nameservers = tuple(nameservers)
        self.static = tuple(static)
        self.min_ttl_s = min_ttl_s
        self.max_ttl_s = max_ttl_s
        self.grace_s = max_ttl_s if grace_s is None else grace_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._lock = asyncio.Lock()
        self._current: Discovered | None = None
        self._current_until = 0.0
        self._last_good: Discovered | None = None
        self._good_until = 0.0
        self.answers: Counter[str] = Counter()  # each new answer, by source (srv, address, static, cache)
        self.failures: Counter[str] = Counter()  # each failed DNS resolution, by FailureReason

    @property
    def current(self) -> Discovered | None:
        """The answer last returned by :meth:`resolve`, or ``None`` before the first one."""
        return self._current

    def next_refresh_in(self) -> float:
        """Seconds until the current answer's TTL runs out (0 before the first resolution)."""
        if self._current is None:
            return 0.0
        return max(0.0, self._current_until - self._clock())

    async def resolve(self) -> Discovered:
        """The carrier endpoints: the current answer while its TTL lasts, else a fresh DNS answer.

        A fresh answer's ``ttl_s`` is the smallest TTL of the RRsets it was built from, clamped; a
        still-valid one is returned with the time it has left. DNS failures come back as a ``"cache"``
        or ``"static"`` answer with ``error`` set, never as an exception.
        """
        async with self._lock:
            now = self._clock()
            if self._current is not None and now < self._current_until:
                return replace(self._current, ttl_s=self._current_until - now)
            if self.mode == "static":
                answer = Discovered(self.static, self.max_ttl_s, "static")
            else:
                answer = await self._ask_dns()
            self._current = answer
            self._current_until = self._clock() + answer.ttl_s
            self.answers[answer.source] += 1
            if answer.reason is not None:
                self.failures[answer.reason.value] += 1
            return answer

    async def watch(self, on_change: Callable[[Discovered], None], stop: asyncio.Event) -> None:
        """Resolve, call ``on_change`` whenever the endpoint list (or its order) changes, sleep until
        the TTL runs out, repeat until ``stop`` is set. The first answer always counts as a change.
        Exceptions from ``on_change`` propagate and end the watch."""
        last: tuple[CarrierEndpoint, ...] | None = None
        while not stop.is_set():
            found = await self.resolve()
            if found.endpoints != last:
                last = found.endpoints
                on_change(found)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.next_refresh_in())

    async def _ask_dns(self) -> Discovered:
        try:
            if self.mode == "srv":
                endpoints, ttls = await self._srv()
            else:
                endpoints, ttls = await self._address()
            if not endpoints:
                raise _DiscoveryFailed(FailureReason.NO_ENDPOINTS, f"{self.name}: no usable endpoints")
        except _DiscoveryFailed as exc:
            return self._degraded(exc.reason, f"{exc.reason}: {exc.error}")
        except (dns.exception.DNSException, OSError) as exc:
            reason = _classify(exc)
            return self._degraded(reason, f"{reason}: {exc}")
        ttl = clamp_ttl(ttls, self.min_ttl_s, self.max_ttl_s)
        answer = Discovered(endpoints, ttl, self.mode)
        self._last_good = answer
        self._good_until = self._clock() + ttl
        return answer

    def _degraded(self, reason: FailureReason, error: str) -> Discovered:
        return degraded_answer(
            last_good=self._last_good,
            good_until=self._good_until,
            now=self._clock(),
            grace_s=self.grace_s,
            static=self.static,
            retry_s=self.min_ttl_s,
            reason=reason,
            error=error,
        )

    def _dns(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            if self.nameservers:
                resolver = dns.asyncresolver.Resolver(configure=False)
                resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, p) for ip, p in self.nameservers]
            else:
                resolver = dns.asyncresolver.Resolver()  # reads /etc/resolv.conf, hence not in __init__
            resolver.timeout = self.timeout_s
            resolver.lifetime = self.timeout_s
            self._resolver = resolver
        return self._resolver

    async def _srv(self) -> tuple[tuple[CarrierEndpoint, ...], list[float]]:
        answer = await self._dns().resolve(self.name, dns.rdatatype.SRV)
        ttls: list[float] = [answer.chaining_result.minimum_ttl]
        records = order_srv(
            SrvRecord(int(r.priority), int(r.weight), int(r.port), r.target.to_text())
            for r in answer.rrset or ()
            if isinstance(r, dns.rdtypes.IN.SRV.SRV)
        )
        targets = list(dict.fromkeys(canonical_name(r.target) for r in records if r.target != "."))
        addresses: dict[str, list[str]] = {}
        for target in targets:
            extra = [
                rrset
                for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA)
                for rrset in answer.response.additional
                if rrset.rdtype == rdtype and canonical_name(rrset.name.to_text()) == target
            ]
            if extra:
                addresses[target] = _addresses_in(extra)
                ttls.extend(rrset.ttl for rrset in extra)
        missing = [t for t in targets if t not in addresses]
        looked_up = await asyncio.gather(
            *(self._host(t, nxdomain_ok=True) for t in missing), return_exceptions=True
        )
        for target, result in zip(missing, looked_up, strict=True):
            if isinstance(result, BaseException):
                raise result
            found, found_ttls = result
            addresses[target] = found
            ttls.extend(found_ttls)
        return srv_endpoints(records, addresses), ttls

    async def _address(self) -> tuple[tuple[CarrierEndpoint, ...], list[float]]:
        found, ttls = await self._host(self.name, nxdomain_ok=False)
        if not found:
            raise _DiscoveryFailed(FailureReason.NO_ANSWER, f"{self.name}: no A or AAAA records")
        return address_endpoints(found, self.port), ttls

    async def _host(self, name: str, *, nxdomain_ok: bool) -> tuple[list[str], list[float]]:
        """A then AAAA addresses of ``name`` and the TTLs of the RRsets found.

        An SRV target that does not exist is skipped (``nxdomain_ok``); anything else fails the whole
        resolution so that a half-answered lookup never replaces a complete cached one.
        """
        resolver = self._dns()
        answers = await asyncio.gather(
            resolver.resolve(name, dns.rdatatype.A, raise_on_no_answer=False),
            resolver.resolve(name, dns.rdatatype.AAAA, raise_on_no_answer=False),
            return_exceptions=True,
        )
        rrsets: list[dns.rrset.RRset] = []
        ttls: list[float] = []
        for answer in answers:
            if isinstance(answer, dns.resolver.NXDOMAIN) and nxdomain_ok:
                return [], []
            if isinstance(answer, BaseException):
                raise answer
            if answer.rrset is not None:
                rrsets.append(answer.rrset)
                ttls.append(answer.chaining_result.minimum_ttl)
        return _addresses_in(rrsets), ttls
