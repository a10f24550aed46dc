"""A small authoritative DNS server on loopback, for testing discovery against real DNS traffic.

Shipped with the product (like ``structlog.testing``) so that the agent's tests, and anyone wiring the
agent into their own tests, can exercise :mod:`edge_agent.discovery` end to end without a real resolver
or zone: the server speaks DNS over UDP (and TCP, for truncated answers) on ``127.0.0.1`` or ``::1`` and
a free port, answers from a zone the test edits while it runs, and counts the queries it was asked so a
test can see when a client came back after a TTL.

    async with AuthoritativeDNS() as dns_server:
        dns_server.set_srv("_edgeinfer._tcp.ingest.example.", [(10, 5, 5555, "hgc.ingest.example.")], 30)
        dns_server.set_a("hgc.ingest.example.", ["127.0.0.11"], 30)
        discovery = GatewayDiscovery("_edgeinfer._tcp.ingest.example.", nameservers=[dns_server.address])

It is deliberately minimal: one class (IN), no wildcards, CNAMEs, delegation or SOA records; a name the
zone does not hold gets NXDOMAIN, a name it holds without the asked type gets an empty NOERROR answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from collections.abc import Sequence
from types import TracebackType
from typing import Self, cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.IN.SRV
import dns.rrset

_UDP_PAYLOAD = 512  # RFC 1035's limit for a UDP answer to a query without EDNS
_BIND_ATTEMPTS = 20  # UDP and TCP must share a port; another process may take the TCP side first


class AuthoritativeDNS:
    """An authoritative DNS responder for tests, bound to a loopback address on a free port.

    Use it as ``async with AuthoritativeDNS() as dns_server`` (or :meth:`start` / :meth:`aclose`) and
    pass :attr:`address` to the resolver under test. The zone can change at any time; each answer
    reflects the zone as it is when the query arrives. With ``include_additional`` the address records
    of SRV targets travel in the additional section, as most authoritative servers send them.
    """

    def __init__(self, *, host: str = "127.0.0.1", tcp: bool = True, include_additional: bool = True) -> None:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"host: the test DNS server binds loopback only, not {host!r}")
        self.host = host
        self.tcp = tcp
        self.include_additional = include_additional
        self.malformed = 0  # datagrams or frames that were not a DNS message, dropped
        self.truncated = 0  # UDP answers too big for the client, sent with TC set (it retries over TCP)
        self._zone: dict[tuple[dns.name.Name, dns.rdatatype.RdataType], dns.rrset.RRset] = {}
        self._queries: Counter[tuple[dns.name.Name, dns.rdatatype.RdataType]] = Counter()
        self._port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tcp_tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The port the server listens on (UDP and, with ``tcp``, TCP); 0 before :meth:`start`."""
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)``, ready for ``GatewayDiscovery(nameservers=[...])``."""
        return self.host, self._port

    async def start(self) -> None:
        """Bind UDP (and TCP) on one free port of ``host``; a no-op when already started."""
        if self._udp is not None:
            return
        loop = asyncio.get_running_loop()
        for _ in range(_BIND_ATTEMPTS):
            transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _UdpProtocol(self), local_addr=(self.host, 0)
            )
            port = int(transport.get_extra_info("sockname")[1])
            if not self.tcp:
                break
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, self.host, port)
                break
            except OSError:
                transport.close()
        else:
            raise OSError(f"no port on {self.host} free for both UDP and TCP after {_BIND_ATTEMPTS} tries")
        self._udp = transport
        self._port = port

    async def aclose(self) -> None:
        """Stop answering and release the port; safe before :meth:`start` and safe twice."""
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            # Python 3.11's wait_closed() does not wait for open connections; end their handlers here.
            for task in self._tcp_tasks:
                task.cancel()
            await asyncio.gather(*self._tcp_tasks, return_exceptions=True)
            await self._tcp.wait_closed()
            self._tcp = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def set_srv(self, name: str, records: Sequence[tuple[int, int, int, str]], ttl: int) -> None:
        """Replace the SRV RRset of ``name`` with ``(priority, weight, port, target)`` records."""
        texts = [f"{p} {w} {port} {dns.name.from_text(target)}" for p, w, port, target in records]
        self._put(dns.rrset.from_text_list(dns.name.from_text(name), ttl, "IN", "SRV", texts))

    def set_a(self, name: str, addresses: Sequence[str], ttl: int) -> None:
        """Replace the A RRset of ``name`` with ``addresses`` (IPv4 literals)."""
        self._put(dns.rrset.from_text_list(dns.name.from_text(name), ttl, "IN", "A", list(addresses)))

    def set_aaaa(self, name: str, addresses: Sequence[str], ttl: int) -> None:
        """Replace the AAAA RRset of ``name`` with ``addresses`` (IPv6 literals)."""
        self._put(dns.rrset.from_text_list(dns.name.from_text(name), ttl, "IN", "AAAA", list(addresses)))

    def remove(self, name: str, rdtype: str | None = None) -> None:
        """Drop ``name`` from the zone (only its ``rdtype`` RRset when given); it then gets NXDOMAIN."""
        owner = dns.name.from_text(name)
        wanted = None if rdtype is None else dns.rdatatype.from_text(rdtype)
        for key in [k for k in self._zone if k[0] == owner and wanted in (None, k[1])]:
            del self._zone[key]

    def query_count(self, name: str, rdtype: str) -> int:
        """How many queries for ``name`` and ``rdtype`` (e.g. ``"SRV"``) arrived, over UDP and TCP."""
        return self._queries[(dns.name.from_text(name), dns.rdatatype.from_text(rdtype))]

    @property
    def total_queries(self) -> int:
        """How many queries arrived in all."""
        return self._queries.total()

    def answer(self, query: dns.message.Message) -> dns.message.Message:
        """The authoritative response to ``query`` from the zone as it is now (pure; counts the query)."""
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if query.opcode() != dns.opcode.QUERY:
            response.set_rcode(dns.rcode.NOTIMP)
            return response
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        question = query.question[0]
        qname, rdtype = question.name, dns.rdatatype.RdataType(question.rdtype)
        self._queries[(qname, rdtype)] += 1
        if question.rdclass != dns.rdataclass.IN:
            response.set_rcode(dns.rcode.REFUSED)
            return response
        if not any(owner == qname for owner, _ in self._zone):
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response
        rrset = self._zone.get((qname, rdtype))
        if rrset is None:
            return response
        response.answer.append(rrset)
        if rdtype == dns.rdatatype.SRV and self.include_additional:
            for rdata in rrset:
                if isinstance(rdata, dns.rdtypes.IN.SRV.SRV):
                    for address_type in (dns.rdatatype.A, dns.rdatatype.AAAA):
                        extra = self._zone.get((rdata.target, address_type))
                        if extra is not None and extra not in response.additional:
                            response.additional.append(extra)
        return response

    def _put(self, rrset: dns.rrset.RRset) -> None:
        self._zone[(rrset.name, rrset.rdtype)] = rrset

    def _reply_wire(self, data: bytes, *, udp: bool) -> bytes | None:
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            self.malformed += 1
            return None
        response = self.answer(query)
        if not udp:
            return response.to_wire()
        limit = max(_UDP_PAYLOAD, query.payload) if query.edns >= 0 else _UDP_PAYLOAD
        try:
            return response.to_wire(max_size=limit)
        except dns.exception.TooBig:
            self.truncated += 1
            truncated = dns.message.make_response(query)
            truncated.flags |= dns.flags.AA | dns.flags.TC
            return truncated.to_wire(max_size=limit)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tcp_tasks.add(task)
        try:
            while True:
                try:
                    size = int.from_bytes(await reader.readexactly(2), "big")
                    data = await reader.readexactly(size)
                except asyncio.IncompleteReadError:
                    return
                wire = self._reply_wire(data, udp=False)
                if wire is None:
                    return
                writer.write(len(wire).to_bytes(2, "big") + wire)
                await writer.drain()
        except ConnectionError:
            return  # the client went away mid-answer; nothing to tell it
        finally:
            if task is not None:
                self._tcp_tasks.discard(task)
            writer.close()


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: AuthoritativeDNS) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not isinstance: Python 3.11's selector datagram transport does not subclass
        # asyncio.DatagramTransport although it is one.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        wire = self._server._reply_wire(data, udp=True)
        if wire is not None and self._transport is not None:
            self._transport.sendto(wire, addr)
