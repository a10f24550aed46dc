"""The agent's own HTTP port: health for the local load balancer and Prometheus metrics.

Metrics are read from the agent's state at scrape time (a custom collector), so the data path never
touches them. Labels are bounded: carriers, statuses, reasons; never request ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:
    from edge_agent.agent import EdgeAgent

NS = "edge"


class AgentCollector:
    """Exports an EdgeAgent's counters and gauges."""

    def __init__(self, agent: EdgeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        stats = agent.stats
        routed = CounterMetricFamily(
            f"{NS}_requests", "Requests taken from local services, by route", labels=["route"]
        )
        routed.add_metric(["local"], stats.local)
        routed.add_metric(["remote"], stats.remote)
        routed.add_metric(["failed_fast"], sum(stats.failed_fast.values()))
        routed.add_metric(["refused"], stats.refused)
        yield routed
        answered = CounterMetricFamily(
            f"{NS}_responses", "Answers given to local services", labels=["status"]
        )
        for status, count in sorted(stats.responses.items()):
            answered.add_metric([status], count)
        yield answered
        orphans = CounterMetricFamily(
            f"{NS}_orphan_responses", "Answers whose caller had gone (e.g. recovered)"
        )
        orphans.add_metric([], stats.orphan_responses)
        yield orphans
        unread = CounterMetricFamily(
            f"{NS}_orphan_acks", "Acks not sent because the local caller was not reading (socket full)"
        )
        unread.add_metric([], stats.orphan_acks)
        yield unread
        uplink = agent.uplink
        if uplink is not None:
            now = time.monotonic()
            up = GaugeMetricFamily(
                f"{NS}_carrier_up", "1 while the carrier answers pings", labels=["carrier"]
            )
            rtt = GaugeMetricFamily(
                f"{NS}_carrier_rtt_seconds", "EWMA round trip to Hong Kong", labels=["carrier"]
            )
            for name, carrier in sorted(uplink.carriers.items()):
                up.add_metric([name], 1.0 if carrier.alive(now, agent.config.uplink.dead_after_s) else 0.0)
                rtt.add_metric([name], carrier.rtt_s)
            yield up
            yield rtt
            inflight = GaugeMetricFamily(f"{NS}_inflight", "Requests sent to Hong Kong and not answered")
            inflight.add_metric([], uplink.inflight)
            yield inflight
            resent = CounterMetricFamily(f"{NS}_resent", "Requests sent again, by reason", labels=["reason"])
            for reason, count in sorted(uplink.stats.resent.items()):
                resent.add_metric([reason], count)
            yield resent
            dup = CounterMetricFamily(f"{NS}_duplicate_responses", "Second answers from Hong Kong, dropped")
            dup.add_metric([], uplink.stats.duplicate_responses)
            yield dup
            rerun = CounterMetricFamily(
                f"{NS}_gateway_reexecutions", "Accepted requests resent after a gateway restart"
            )
            rerun.add_metric([], uplink.stats.re_executions)
            yield rerun
        spool = agent.spool
        if spool is not None:
            for name, value, doc in (
                ("spool_records", spool.live_records, "Requests in the spool, not yet accepted by Hong Kong"),
                ("spool_bytes", spool.disk_bytes, "Spool size on disk"),
                ("spool_oldest_age_seconds", spool.oldest_age_s, "Age of the oldest spooled request"),
            ):
                gauge = GaugeMetricFamily(f"{NS}_{name}", doc)
                gauge.add_metric([], value)
                yield gauge
            drops = CounterMetricFamily(
                f"{NS}_spool_drops", "Spool records dropped or skipped, by reason", labels=["reason"]
            )
            for reason, count in sorted(spool.drops.items()):
                drops.add_metric([str(reason)], count)
            yield drops


class AgentHttp:
    """``/healthz``, ``/readyz`` (a live carrier to Hong Kong, or a local tier) and ``/metrics``."""

    def __init__(self, agent: EdgeAgent) -> None:
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
