"""The agent's own HTTP port: health for the local load balancer and Prometheus metrics.

Metrics are read from the agent's state at scrape time (a custom collector), so the data path never
touches them. Labels are bounded: carriers, statuses, reasons; never request ids. This module sees the
agent only through ``ObservedAgent`` (what it reads), so it does not import the agent that serves it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, get_args

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from edge_agent.admission import Admission
from edge_agent.callers import Callers
from edge_agent.config import AgentConfig
from edge_agent.discovery import DiscoverySource, FailureReason, GatewayDiscovery
from edge_agent.errors import ErrorCounts
from edge_agent.parked import ParkedAnswers
from edge_agent.spool import Spool
from edge_agent.stats import AgentStats
from edge_agent.uplink import Uplink
from edge_agent.uplink.carriers import MONITORED
from edgewire import labels

NS = "edge"


def _counter(name: str, doc: str, value: float) -> Metric:
    family = CounterMetricFamily(f"{NS}_{name}", doc)
    family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float) -> Metric:
    family = GaugeMetricFamily(f"{NS}_{name}", doc)
    family.add_metric([], value)
    return family


def _counters(name: str, doc: str, label: str, counts: Iterable[tuple[str, float]]) -> Metric:
    family = CounterMetricFamily(f"{NS}_{name}", doc, labels=[label])
    for value, count in counts:
        family.add_metric([value], count)
    return family


def _known(table: Mapping[int, str]) -> list[str]:
    """A wire enum's labels, UNSPECIFIED left out, ``other`` (a value newer than this agent) added."""
    return [label for value, label in sorted(table.items()) if value] + ["other"]


class ObservedAgent(Protocol):
    """What the HTTP port reads from the agent (``EdgeAgent`` is one): its parts exist once started."""

    @property
    def config(self) -> AgentConfig: ...

    @property
    def stats(self) -> AgentStats: ...

    @property
    def errors(self) -> ErrorCounts: ...

    @property
    def uplink(self) -> Uplink | None: ...

    @property
    def discovery(self) -> GatewayDiscovery | None: ...

    @property
    def spool(self) -> Spool | None: ...

    @property
    def local(self) -> object | None:
        """The local tier, when one is loaded (only its presence is read)."""

    @property
    def callers(self) -> Callers | None: ...

    @property
    def admission(self) -> Admission | None: ...


class AgentCollector:
    """Exports an EdgeAgent's counters and gauges."""

    def __init__(self, agent: ObservedAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        yield from self._intake(agent.stats)
        yield _counters(
            "errors",
            "Unexpected errors caught, logged and survived, by where they were caught",
            "reason",
            [(str(reason), count) for reason, count in sorted(agent.errors.by_reason.items())],
        )
        if agent.uplink is not None:
            yield from self._uplink(agent.uplink, agent.config.uplink.dead_after_s)
        if agent.discovery is not None:
            yield from self._discovery(agent.discovery)
        if agent.spool is not None:
            yield from self._spool(agent.spool)
        if agent.callers is not None:
            yield from self._parked(agent.callers.parked)
        if agent.admission is not None:
            yield _counter(
                "reattached_requests",
                "Requests a reconnected caller sent again and the agent attached to what it held for it",
                agent.admission.reattached,
            )

    @staticmethod
    def _parked(parked: ParkedAnswers) -> Iterator[Metric]:
        yield _gauge("parked_answers_held", "Answers held for callers not connected", len(parked))
        yield _gauge("parked_answer_bytes", "What the held answers cost", parked.nbytes)
        yield _counters(
            "parked_answers",
            "Answers parked for a caller that was not connected, and what became of them",
            "outcome",
            [
                ("parked", parked.parked),
                ("claimed", parked.claimed),
                *((str(reason), count) for reason, count in sorted(parked.dropped.items())),
            ],
        )

    @staticmethod
    def _intake(stats: AgentStats) -> Iterator[Metric]:
        yield _counters(
            "requests",
            "Requests taken from local services, by route",
            "route",
            [
                ("local", stats.local),
                ("remote", stats.remote),
                ("failed_fast", sum(stats.failed_fast.values())),
                ("refused", stats.refused),
            ],
        )
        yield _counters(
            "failed_fast",
            "Requests answered DEADLINE_EXCEEDED without being tried, by reason",
            "reason",
            sorted(stats.failed_fast.items()),  # every reason, from the start
        )
        yield _counters(
            "responses", "Answers given to local services", "status", sorted(stats.responses.items())
        )
        yield _counter(
            "orphan_responses", "Answers whose caller had gone (e.g. recovered)", stats.orphan_responses
        )
        yield _counter(
            "orphan_acks",
            "Acks not sent because the local caller was not reading (socket full)",
            stats.orphan_acks,
        )
        yield _counters(
            "intake_bad_frames",
            "Intake frames not taken (not decodable, or not a RequestBatch), by reason",
            "reason",
            [(reason, stats.bad_frames[reason]) for reason in _known(labels.REJECT)],
        )

    @staticmethod
    def _uplink(uplink: Uplink, dead_after_s: float) -> Iterator[Metric]:
        now = time.monotonic()
        up = GaugeMetricFamily(f"{NS}_carrier_up", "1 while the carrier answers pings", labels=["carrier"])
        rtt = GaugeMetricFamily(
            f"{NS}_carrier_rtt_seconds", "EWMA round trip to Hong Kong", labels=["carrier"]
        )
        for name, carrier in sorted(uplink.carriers.items()):
            up.add_metric([name], 1.0 if carrier.alive(now, dead_after_s) else 0.0)
            rtt.add_metric([name], carrier.rtt_s)
        yield up
        yield rtt
        yield from AgentCollector._carrier_events(uplink)
        window = uplink.window
        yield _gauge(
            "send_window", "Requests Hong Kong may hold from this agent now (slow start, AIMD)", window.size
        )
        yield _counter("send_window_cuts", "Times an OVERLOADED refusal halved the send window", window.cuts)
        yield _counter(
            "send_window_restarts",
            "Times a gateway restart sent the window back to its start",
            window.restarts,
        )
        stats = uplink.stats
        yield _counter("uplink_frames_sent", "Request frames sent to Hong Kong", stats.sent_frames)
        yield _counter(
            "uplink_frames_uncompressed",
            "Frames sent without zstd because it would have saved less than zstd_min_saving",
            stats.sent_uncompressed,
        )
        yield _counter(
            "uplink_frames_compressed_off_loop",
            "Request frames encoded on the uplink's own thread (batching.compress_off_loop_bytes)",
            stats.compressed_off_loop,
        )
        yield _counter(
            "uplink_requests_sent", "Requests sent to Hong Kong, resends included", stats.sent_requests
        )
        yield _gauge("inflight", "Requests sent to Hong Kong and not answered", uplink.inflight)
        yield _counters("resent", "Requests sent again, by reason", "reason", sorted(stats.resent.items()))
        yield _counters(
            "frames_rejected",
            "Request frames Hong Kong refused whole, by reason (resent, split or failed per request)",
            "reason",
            [(reason, stats.frames_rejected[reason]) for reason in _known(labels.REJECT)],
        )
        yield _counters(
            "nacks",
            "Requests Hong Kong refused at intake, by reason (overloaded and draining are resent)",
            "reason",
            [(reason, stats.nacks[reason]) for reason in _known(labels.NACK)],
        )
        yield _counter(
            "duplicate_responses", "Second answers from Hong Kong, dropped", stats.duplicate_responses
        )
        yield _counter(
            "late_responses",
            "Answers from Hong Kong after the request's deadline had passed here (dropped)",
            stats.late_responses,
        )
        yield _counter(
            "over_budget_holds",
            "over_budget refusals from Hong Kong: each held this agent's new frames to that gateway back for "
            "the retry-after it named",
            stats.over_budget_holds,
        )
        yield _counter(
            "gateway_reexecutions", "Accepted requests resent after a gateway restart", stats.re_executions
        )
        yield _counters(
            "uplink_bad_frames",
            "Frames from Hong Kong not decodable, by reason (dropped)",
            "reason",
            [(reason, stats.bad_frames[reason]) for reason in _known(labels.REJECT)],
        )

    @staticmethod
    def _carrier_events(uplink: Uplink) -> Iterator[Metric]:
        """Each carrier's connection life (socket monitor) and liveness changes, every series from start."""
        events = CounterMetricFamily(
            f"{NS}_carrier_connection_events",
            "Socket monitor events of each carrier's connection (connect retried, handshake failed, ...)",
            labels=["carrier", "event"],
        )
        changes = CounterMetricFamily(
            f"{NS}_carrier_changes", "Carriers going from dead to live and back", labels=["carrier", "change"]
        )
        for name, carrier in sorted(uplink.carriers.items()):
            for event in sorted(set(MONITORED.values())):
                events.add_metric([name, event], carrier.events[event])
            changes.add_metric([name, "came_up"], carrier.came_up)
            changes.add_metric([name, "went_down"], carrier.went_down)
        yield events
        yield changes

    @staticmethod
    def _discovery(discovery: GatewayDiscovery) -> Iterator[Metric]:
        yield _counters(
            "discovery_answers",
            "Carrier lists discovery produced, by source (cache or static: DNS failed)",
            "source",
            [(source, discovery.answers[source]) for source in get_args(DiscoverySource)],
        )
        yield _counters(
            "discovery_failures",
            "DNS resolutions that failed, by reason",
            "reason",
            [(reason.value, discovery.failures[reason.value]) for reason in FailureReason],
        )
        current = discovery.current
        yield _gauge(
            "discovery_endpoints",
            "Carrier endpoints in the current answer",
            len(current.endpoints) if current is not None else 0,
        )

    @staticmethod
    def _spool(spool: Spool) -> Iterator[Metric]:
        yield _gauge("spool_records", "Requests in the spool, not yet answered", spool.live_records)
        yield _gauge("spool_bytes", "Spool size on disk", spool.disk_bytes)
        yield _gauge("spool_oldest_age_seconds", "Age of the oldest spooled request", spool.oldest_age_s)
        yield _counters(
            "spool_drops",
            "Spool records dropped or skipped, by reason",
            "reason",
            [(str(reason), count) for reason, count in sorted(spool.drops.items())],
        )
        yield _gauge(
            "spool_ignored_files",
            "Files in the spool directory that are not segments (left alone)",
            spool.ignored_files,
        )


class AgentHttp:
    """``/healthz``, ``/readyz`` (a live carrier to Hong Kong, or a local tier) and ``/metrics``."""

    def __init__(self, agent: ObservedAgent) -> None:
        self._agent = agent
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(AgentCollector(agent))
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []  # the bound port, when port 0 was asked
        self.port = int(sockets[0].getsockname()[1]) if sockets else port

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="OK\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        uplink = self._agent.uplink
        remote = uplink is not None and uplink.best() is not None
        local = self._agent.local is not None
        status = 200 if remote or local else 503
        return web.Response(
            status=status, text=f"hong_kong={'up' if remote else 'down'} local_tier={local}\n"
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
