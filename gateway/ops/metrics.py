"""Prometheus metrics of one gateway, in a registry of its own (several gateways can share a process).

Label values are bounded: carriers, pools, backends, models, tiers and regions come from config or fixed
enums; reasons from wire or routing enums. Agent ids, request ids and tenants are never labels.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from gateway.ops.tally import Tally
from routing.regions import REGION_NAMES, UNKNOWN_REGION

# The _created series double the scrape for no use on a long-running daemon.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it unannotated

NS = "hkgw"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OTHER = "other"
M = TypeVar("M", Counter, Gauge, Histogram)


class _ReadCounters:
    """A labelled counter whose values live elsewhere and are read at scrape time."""

    def __init__(self, name: str, doc: str, label: str, read: Callable[[], Mapping[str, int]]) -> None:
        self._name, self._doc, self._label, self._read = name, doc, label, read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in sorted(self._read().items()):
            family.add_metric([value], count)
        yield family


BACKGROUND_TASKS: Final = ("health", "watchdog")
"""The gateway's background loops (``hkgw_background_task_failures_total``'s ``task``)."""


class CloseErrorReason(enum.StrEnum):
    """Why closing the gateway met an error: ``hkgw_close_errors_total``'s ``reason``."""

    TASK_FAILED = "task_failed"  # a background task had ended with an exception before close
    BACKEND_CLOSE_FAILED = "backend_close_failed"  # a backend's aclose raised


class LabelGuard:
    """Maps a value onto a fixed set of allowed label values, anything else becoming ``other``."""

    def __init__(self, allowed: Iterable[str], fallback: str = OTHER) -> None:
        self._allowed = frozenset(allowed)
        self._fallback = fallback

    def __call__(self, value: str) -> str:
        return value if value in self._allowed else self._fallback


class GatewayMetrics:
    """Every metric the gateway exports. ``render()`` gives the Prometheus text format."""

    def __init__(self, models: Iterable[str]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # First in the registry: every collection adds the hot path's held counts before reading any series.
        self.tally = Tally(registry=r)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.model_label = LabelGuard(models)
        self.region_label = LabelGuard(REGION_NAMES, UNKNOWN_REGION)

        self._frame_metrics(r)
        self.requests = Counter(
            f"{NS}_requests",
            "Requests received, by region, model and priority class",
            ["region", "model", "priority"],
            registry=r,
        )
        self.accepted = Counter(
            f"{NS}_requests_accepted", "Requests acknowledged as accepted", ["carrier"], registry=r
        )
        self.duplicates = Counter(
            f"{NS}_requests_duplicate", "Requests already accepted earlier (resends)", ["carrier"], registry=r
        )
        self.nacks = Counter(
            f"{NS}_requests_nacked", "Requests refused at ingest, by reason", ["reason"], registry=r
        )
        self.decisions = Counter(
            f"{NS}_route_decisions",
            "Routing decisions by tier, pool and reason",
            ["tier", "pool", "reason"],
            registry=r,
        )
        self.responses = Counter(
            f"{NS}_responses",
            "Responses sent, by status, tier and pool",
            ["status", "tier", "pool"],
            registry=r,
        )
        self.latency = Histogram(
            f"{NS}_request_latency_seconds",
            "Receipt at the gateway to reply, by tier",
            ["tier", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            f"{NS}_queue_wait_seconds",
            "Time a request waited in its pool queue",
            ["pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{NS}_batch_size", "Requests per backend call", ["pool"], buckets=BATCH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(f"{NS}_queue_depth", "Requests waiting per pool", ["pool"], registry=r)
        self.inflight = Gauge(
            f"{NS}_inflight_batches", "Backend calls in progress per pool", ["pool"], registry=r
        )
        self.shed = Counter(
            f"{NS}_shed",
            "Requests answered OVERLOADED or expired in queue, by pool and reason",
            ["pool", "reason"],
            registry=r,
        )
        self.backend_calls = Counter(
            f"{NS}_backend_calls", "Backend calls by outcome", ["backend", "outcome"], registry=r
        )
        self.backend_latency = Histogram(
            f"{NS}_backend_latency_seconds",
            "Backend call duration",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.breaker_state = Gauge(
            f"{NS}_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", ["backend"], registry=r
        )
        self.pool_healthy = Gauge(
            f"{NS}_pool_healthy", "1 when the pool can take traffic", ["pool"], registry=r
        )
        self.carrier_up = Gauge(
            f"{NS}_carrier_up", "Carrier health: 1 UP, 0.5 DEGRADED, 0 otherwise", ["carrier"], registry=r
        )
        self.carrier_peers = Gauge(
            f"{NS}_carrier_peers", "Agent connections per carrier", ["carrier"], registry=r
        )
        self.carrier_connections = Counter(
            f"{NS}_carrier_connections",
            "Agent connection events on each carrier's ROUTER (socket monitor), by event",
            ["carrier", "event"],
            registry=r,
        )
        self.handshake_failures = Counter(
            f"{NS}_handshake_failures",
            "ZMTP handshakes refused, by reason",
            ["carrier", "reason"],
            registry=r,
        )
        self.auth_rejected = Counter(
            f"{NS}_auth_rejected", "Agents refused by ZAP, by reason", ["reason"], registry=r
        )
        self._reply_metrics(r)
        self.dedupe_entries = Gauge(f"{NS}_dedupe_entries", "Request ids in the dedupe window", registry=r)
        self.dedupe_evicted = Counter(
            f"{NS}_dedupe_evicted_early",
            "Ids dropped from the dedupe window by its count bound before their time (dedupe got weaker)",
            registry=r,
        )
        self.draining = Gauge(f"{NS}_draining", "1 while the gateway drains", registry=r)
        self.ready = Gauge(f"{NS}_ready", "1 when every tier has a healthy pool", registry=r)
        self.padding_waste = Histogram(
            f"{NS}_padding_waste_ratio",
            "Padded share of a batch's input elements",
            ["model"],
            buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
            registry=r,
        )
        self.input_rejected = Counter(
            f"{NS}_input_rejected",
            "Requests the CPU stage refused, by reason",
            ["model", "reason"],
            registry=r,
        )
        self.input_truncated = Counter(
            f"{NS}_input_truncated",
            "Requests the CPU stage served cut to the model's limit (text over max_tokens)",
            ["model"],
            registry=r,
        )
        self.ingest_errors = Counter(
            f"{NS}_ingest_errors",
            "Frames whose handling raised (a bug; the carrier keeps going)",
            ["carrier"],
            registry=r,
        )
        self.cpu_worker_restarts = Counter(
            f"{NS}_cpu_worker_restarts",
            "CPU workers replaced after one died (or was killed for a hung task)",
            registry=r,
        )
        self.cpu_task_timeouts = Counter(
            f"{NS}_cpu_task_timeouts",
            "CPU stage tasks that ran past [cpu] task_timeout_s (their worker was killed and replaced)",
            registry=r,
        )
        self.cpu_workers_busy = Gauge(
            f"{NS}_cpu_workers_busy", "CPU worker processes running a task now", registry=r
        )
        self.batch_isolations = Counter(
            f"{NS}_batch_isolations",
            "Batches served apart after one of their requests may have failed them, by pool, stage "
            "(prepare, infer, finish) and how (split: into halves; singly: each request retried alone)",
            ["pool", "stage", "how"],
            registry=r,
        )
        self.cpu_arena_fallbacks = Counter(
            f"{NS}_cpu_arena_fallbacks",
            "Prepared batches returned through the pipe instead of shared memory, by reason",
            ["reason"],
            registry=r,
        )
        self.reloads = Counter(f"{NS}_reloads", "Config reloads (SIGHUP) by outcome", ["outcome"], registry=r)
        self.capture_records = Counter(
            f"{NS}_capture_records",
            "Messages offered to traffic capture, by outcome (written, or dropped and why)",
            ["outcome"],
            registry=r,
        )
        self.capture_bytes = Counter(
            f"{NS}_capture_written_bytes", "Compressed bytes written to capture files", registry=r
        )
        self.admin_refused = Counter(
            f"{NS}_admin_refused",
            "Admin HTTP requests refused for a missing or wrong bearer token",
            ["reason"],
            registry=r,
        )
        for reason in ("missing", "wrong"):
            self.admin_refused.labels(reason)
        self.capture_active = Gauge(f"{NS}_capture_active", "1 while traffic capture is on", registry=r)
        self._lifecycle_metrics(r)

    def _frame_metrics(self, r: CollectorRegistry) -> None:
        """Frames as they arrive: received, refused whole, decompressed off the event loop."""
        self.frames_received = Counter(
            f"{NS}_frames_received", "Frames received, by carrier and kind", ["carrier", "kind"], registry=r
        )
        self.bytes_received = Counter(
            f"{NS}_received_bytes", "Payload and envelope bytes received", ["carrier"], registry=r
        )
        self.frames_rejected = Counter(
            f"{NS}_frames_rejected", "Frames refused whole, by reason", ["carrier", "reason"], registry=r
        )
        self.read_pauses = Counter(
            f"{NS}_carrier_read_pauses",
            "Pauses of a carrier's reading that paced frames of connections held over budget",
            ["carrier"],
            registry=r,
        )
        self.held_connections = Gauge(
            f"{NS}_held_connections",
            "Connections held by the per-agent cost budget now: their agent's request batches refused on"
            " the envelope until the hold ends",
            registry=r,
        )
        self.inflated_off_loop = Counter(
            f"{NS}_frames_inflated_off_loop",
            "Large zstd frames decompressed on the inflate thread instead of the event loop",
            ["carrier"],
            registry=r,
        )
        self.inflate_pending = Gauge(
            f"{NS}_inflate_pending", "Frames waiting for or in the inflate thread", registry=r
        )
        self.ingest_backlog = Gauge(
            f"{NS}_ingest_backlog_frames",
            "Request frames read and waiting for a turn on the event loop (gateway/ingress/backlog.py)",
            registry=r,
        )

    def _reply_metrics(self, r: CollectorRegistry) -> None:
        """The way back to agents: answers that found no route, waited for one, or took another carrier."""
        self.replies_undeliverable = Counter(
            f"{NS}_replies_undeliverable",
            "Reply frames that found no route to their agent, by reason",
            ["reason"],
            registry=r,
        )
        self.pending_replies = Gauge(
            f"{NS}_pending_replies", "Responses waiting for their agent to return", registry=r
        )
        self.replies_moved = Counter(
            f"{NS}_replies_moved",
            "Responses sent on another carrier than the one their request was asked on (that route was"
            " gone or silent past the heartbeat timeout)",
            registry=r,
        )

    def _lifecycle_metrics(self, r: CollectorRegistry) -> None:
        """Errors of the gateway's own lifecycle: background loops that died, failures while closing."""
        self.close_errors = Counter(
            f"{NS}_close_errors",
            "Errors met while the gateway closed (logged, the rest still closed), by component (a background"
            " task's or a backend's name) and reason (CloseErrorReason)",
            ["component", "reason"],
            registry=r,
        )
        self.background_task_failures = Counter(
            f"{NS}_background_task_failures",
            "Background loops of the gateway (health, watchdog) that ended with an error, counted at once",
            ["task"],
            registry=r,
        )
        for task in BACKGROUND_TASKS:
            self.background_task_failures.labels(task)

    def read_counters(self, name: str, doc: str, label: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Export ``hkgw_<name>_total{label}`` from ``read()`` (label value -> count) at each scrape: for
        counts that other objects keep."""
        self.registry.register(_ReadCounters(f"{NS}_{name}", doc, label, read))

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, cached: the label sets are bounded and the hot path asks often."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)
