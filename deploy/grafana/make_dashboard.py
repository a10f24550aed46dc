"""Writes deploy/grafana/hk-edge-gateway.json, the committed dashboard.

    python deploy/grafana/make_dashboard.py

Every query uses only metric names the gateway and the agent export (tests/deploy checks it).
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS = [
    # (title, unit, [(expr, legend)])
    (
        "Frames received per carrier",
        "reqps",
        [("sum by (carrier) (rate(hkgw_frames_received_total[1m]))", "{{carrier}}")],
    ),
    (
        "Carrier health (1 UP, 0.5 DEGRADED, 0 DOWN/DRAINING)",
        "none",
        [("hkgw_carrier_up", "{{instance}} {{carrier}}")],
    ),
    ("Requests per region", "reqps", [("sum by (region) (rate(hkgw_requests_total[1m]))", "{{region}}")]),
    (
        "Route decisions by tier and reason",
        "reqps",
        [("sum by (tier, reason) (rate(hkgw_route_decisions_total[1m]))", "{{tier}} {{reason}}")],
    ),
    (
        "Gateway latency per tier (p50, p99)",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (tier, le) (rate(hkgw_request_latency_seconds_bucket[5m])))",
                "p50 {{tier}}",
            ),
            (
                "histogram_quantile(0.99, sum by (tier, le) (rate(hkgw_request_latency_seconds_bucket[5m])))",
                "p99 {{tier}}",
            ),
        ],
    ),
    (
        "Queue wait p99 per pool",
        "s",
        [
            (
                "histogram_quantile(0.99, sum by (pool, le) (rate(hkgw_queue_wait_seconds_bucket[5m])))",
                "{{pool}}",
            )
        ],
    ),
    (
        "Batch size per pool (mean, p90)",
        "none",
        [
            (
                "sum by (pool) (rate(hkgw_batch_size_sum[5m]))"
                " / sum by (pool) (rate(hkgw_batch_size_count[5m]))",
                "mean {{pool}}",
            ),
            ("histogram_quantile(0.9, sum by (pool, le) (rate(hkgw_batch_size_bucket[5m])))", "p90 {{pool}}"),
        ],
    ),
    ("Queue depth per pool", "none", [("sum by (pool) (hkgw_queue_depth)", "{{pool}}")]),
    (
        "Shed by pool and reason",
        "reqps",
        [("sum by (pool, reason) (rate(hkgw_shed_total[1m]))", "{{pool}} {{reason}}")],
    ),
    (
        "Rejected: nacks and refused frames by reason",
        "reqps",
        [
            ("sum by (reason) (rate(hkgw_requests_nacked_total[1m]))", "nack {{reason}}"),
            ("sum by (reason) (rate(hkgw_frames_rejected_total[1m]))", "frame {{reason}}"),
        ],
    ),
    (
        "Request frames waiting in the ingest backlog (not realtime: served in turns)",
        "none",
        [("sum(hkgw_ingest_backlog_frames)", "waiting")],
    ),
    (
        "Large frames decompressed off the event loop",
        "none",
        [
            ("sum by (carrier) (rate(hkgw_frames_inflated_off_loop_total[1m]))", "per s {{carrier}}"),
            ("sum(hkgw_inflate_pending)", "out now"),
        ],
    ),
    (
        "Connections held over budget (a flood ignoring its retry-after), carrier reads paused for them",
        "none",
        [
            ("sum(hkgw_held_connections)", "held now"),
            ("sum by (carrier) (rate(hkgw_carrier_read_pauses_total[1m]))", "pauses per s {{carrier}}"),
        ],
    ),
    (
        "Backends: calls by outcome, breaker state",
        "none",
        [
            ("sum by (backend, outcome) (rate(hkgw_backend_calls_total[1m]))", "{{backend}} {{outcome}}"),
            ("hkgw_breaker_state", "breaker {{backend}}"),
        ],
    ),
    (
        "Agents: spool",
        "none",
        [
            ("edge_spool_records", "records {{instance}}"),
            ("edge_spool_oldest_age_seconds", "oldest age s {{instance}}"),
        ],
    ),
    (
        "Agents: round trip to Hong Kong per carrier",
        "s",
        [("edge_carrier_rtt_seconds", "{{instance}} {{carrier}}")],
    ),
    (
        "Agents: refused by Hong Kong (nacks, whole frames) and failed fast, by reason",
        "ops",
        [
            ("sum by (reason) (rate(edge_nacks_total[5m]))", "nack {{reason}}"),
            ("sum by (reason) (rate(edge_frames_rejected_total[5m]))", "frame {{reason}}"),
            ("sum by (reason) (rate(edge_failed_fast_total[5m]))", "failed fast {{reason}}"),
        ],
    ),
    (
        "Agents: DNS discovery failures, carriers known",
        "none",
        [
            (
                "sum by (instance, reason) (rate(edge_discovery_failures_total[5m]))",
                "fail/s {{instance}} {{reason}}",
            ),
            ("edge_discovery_endpoints", "carriers {{instance}}"),
        ],
    ),
    ("Capture", "none", [("sum by (outcome) (rate(hkgw_capture_records_total[1m]))", "{{outcome}}")]),
]


def dashboard() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "title": "hk-edge-gateway",
        "uid": "hk-edge-gateway",
        "schemaVersion": 39,
        "version": 1,
        "tags": ["hk-edge-gateway"],
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("hk-edge-gateway.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
