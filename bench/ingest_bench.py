"""Issue 9's whole-path figures in one run: ingest vs transport baselines, open-loop latency, 10k in flight.

    python -m bench.ingest_bench [--seconds 5] [--repeats 3] [--write]

1. **Ingest**: records/s from a DEALER "agent" through the gateway (null backend: CPU stage, routing,
   batching and replies as in production, the model free) and back as responses, frames of 100 realistic
   requests encoded before the run, 8 frames in flight; again with the driver encoding each frame (on the
   same two cores), and through a real edge agent (the 10k run). Baselines in the same run, same
   serialized requests (bench/baselines.py): raw pyzmq PUSH/PULL one message per frame, one grpcio
   bidirectional stream, one HTTP/JSON POST each; and, with the gateway's own frames and driver, a minimal
   Python ingest (bench/minimal_ingest.py: decode, dedupe, ack, empty answers, nothing else).
2. **Latency**: open loop (each latency from the request's scheduled send time, so stalls are not hidden),
   one realtime request per frame at several offered rates; the gateway against a raw DEALER/ROUTER echo
   (bench/echo.py) in the same run; overhead = gateway minus echo at the same percentile.
3. **Stress**: 10,000 requests in flight at once (100 frames of 100) on the fresh gateway, and again
   through a real edge agent at the end: every one answered or explicitly refused (Nack or a non-OK
   status), none lost; the gateway's and the agent's peak memory.

Plots (docs/bench/): latency CDF per tier, and answered rate vs offered rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, cast

import numpy as np
import zmq
from google.protobuf import json_format

from bench import baselines
from bench.agent_bench import running_agent
from bench.gateway_bench import (
    FEATURES,
    Peer,
    Tracker,
    cpu_seconds,
    drain,
    open_loop_drive,
    process_tree,
    restamp,
    start_gateway,
    throughput,
    workload,
)
from bench.report import BENCHMARKS_MD, machine, stamp, table, update_section
from edge_agent.client import EdgeClient
from edgewire import FrameCodec, pb

NO_ANSWER = "no answer from the edge agent in time"  # what EdgeClient answers for a request never answered

RATES = (500.0, 1000.0, 2000.0)
LATENCY_HEADER = [
    "offered",
    "answered/s",
    "p50 ms gw / echo",
    "p99 ms gw / echo",
    "p50 overhead",
    "p99 overhead",
    "lost",
    "gw p99 ms per run",
]
PLOTS = BENCHMARKS_MD.parent / "bench"


class TierTracker(Tracker):
    """Also keeps each answered request's tier and latency, and the gateway's part of it (the answer's
    ``timing.total_us``: from the request's receipt, decoded, to its reply)."""

    def __init__(self, codec: FrameCodec, is_gateway: bool) -> None:
        super().__init__(codec, is_gateway)
        self.by_tier: dict[str, list[float]] = defaultdict(list)
        self.gateway_s: list[float] = []
        self.queue_s: list[float] = []  # of it, the wait in the pool's queue (``timing.queue_us``)

    def received(self, frames: list[bytes], at: float) -> None:
        if self.is_gateway:
            decoded = self.codec.decode(frames)
            if isinstance(decoded.payload, pb.ResponseBatch):
                for r in decoded.payload.responses:
                    if r.request_id in self.sent_at:
                        tier = pb.Tier.Name(r.tier).removeprefix("TIER_").lower()
                        self.by_tier[tier].append(at - self.sent_at[r.request_id])
                        self.gateway_s.append(r.timing.total_us / 1e6)
                        self.queue_s.append(r.timing.queue_us / 1e6)
        super().received(frames, at)


def open_loop(
    peer: Peer,
    requests: list[pb.InferRequest],
    rate: float,
    seconds: float,
    priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_REALTIME,
) -> dict[str, Any]:
    """One request per frame (realtime unless ``priority`` says) at ``rate``/s for ``seconds``; latencies
    from the scheduled times."""
    tracker = TierTracker(FrameCodec(), not peer.name.startswith("echo"))
    elapsed = open_loop_drive(peer, requests, rate, seconds, tracker, priority=priority)
    total = int(rate * seconds)
    lat = np.array(tracker.latencies) * 1e3
    return {
        "peer": peer.name,
        "rate": rate,
        "answered": tracker.done,
        "answered_per_s": tracker.done / elapsed,
        "lost": total - tracker.done - sum(tracker.nacks.values()),
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "latencies_ms": lat.tolist(),
        "by_tier_ms": {t: (np.array(v) * 1e3).tolist() for t, v in tracker.by_tier.items()},
        "gateway_ms": (np.array(tracker.gateway_s) * 1e3).tolist(),
        "queue_ms": (np.array(tracker.queue_s) * 1e3).tolist(),
    }


def open_loop_repeated(
    peer: Peer, requests: list[pb.InferRequest], rate: float, seconds: float, repeats: int
) -> dict[str, Any]:
    """``repeats`` open-loop runs at ``rate``, their latencies pooled: one run's p99 at a rate near the
    gateway's limit swings by several times between runs on a shared two-core machine."""
    runs = [open_loop(peer, requests, rate, seconds) for _ in range(repeats)]
    latencies = [v for r in runs for v in r["latencies_ms"]]
    lat = np.array(latencies)
    by_tier: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        for tier, values in r["by_tier_ms"].items():
            by_tier[tier].extend(values)
    return {
        "peer": peer.name,
        "rate": rate,
        "answered": sum(r["answered"] for r in runs),
        "answered_per_s": float(np.mean([r["answered_per_s"] for r in runs])),
        "lost": sum(r["lost"] for r in runs),
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan"),
        "p99_ms_runs": [r["p99_ms"] for r in runs],
        "latencies_ms": latencies,
        "by_tier_ms": dict(by_tier),
    }


def prebuild(requests: list[pb.InferRequest], frames: int, batch: int = 100) -> list[list[bytes]]:
    """``frames`` RequestBatch frames of ``batch`` requests (fresh ids), encoded before a run starts.

    The agents run on their own machines in production; encoding ahead keeps the driver's encoding off the
    two cores the gateway is measured on (the edge agent's own rate is bench/agent_bench.py's).
    """
    codec = FrameCodec()
    out = []
    for f in range(frames):
        chunk = [requests[(f * batch + i) % len(requests)] for i in range(batch)]
        restamp(chunk, 120.0)
        out.append(
            codec.encode(
                pb.RequestBatch(requests=chunk), agent_id="bench", region="us-west", features=FEATURES
            )
        )
    return out


def minimal_ingest(requests: list[pb.InferRequest], seconds: float) -> dict[str, Any]:
    """bench/minimal_ingest.py (decode, dedupe, ack, empty answers and nothing else) with the gateway's
    driver and frames: one run, ended by ``seconds`` or by the 4,000 frames built for it (~310 MB), which
    at ~170k records/s last ~2.4 s."""
    peer = Peer("minimal ingest", [sys.executable, "-m", "bench.minimal_ingest"], ready="stdout")
    try:
        ingest(peer, prebuild(requests, 20), 1.0)
        frames = prebuild(requests, 4000)
        run = ingest(peer, frames, seconds)
        return {"records_per_s": run["records_per_s"], "records": run["answered"], "seconds": run["seconds"]}
    finally:
        peer.close()


def ingest(peer: Peer, prebuilt: list[list[bytes]], seconds: float, window: int = 8) -> dict[str, Any]:
    """Closed loop over frames encoded beforehand: ``window`` frames' worth of requests in flight.

    Answers are counted from each response frame's envelope (``record_count``), refusals from the acks'
    nacks: the driver shares the gateway's two cores and parses no response body. That every request
    is answered, with what status, is what the stress run checks, request by request.
    """
    codec = FrameCodec()
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    batch = pb.Envelope.FromString(prebuilt[0][0]).record_count
    sent = answered = refused = 0
    cpu_before, _ = cpu_seconds(peer.proc.pid)
    start = time.perf_counter()
    end = start + seconds
    frames_left = iter(prebuilt)
    while True:
        now = time.perf_counter()
        while sent - answered - refused < window * batch and now < end:
            outgoing = next(frames_left, None)
            if outgoing is None:
                end = now
                break
            peer.sock.send_multipart(outgoing, copy=False)
            sent += batch
        if sent == answered + refused:
            break
        if not poller.poll(10_000):
            raise RuntimeError(f"{peer.name}: nothing back for 10 s")
        while True:
            try:
                frames = peer.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            envelope = pb.Envelope.FromString(frames[0])
            if envelope.kind == pb.MESSAGE_KIND_RESPONSE_BATCH:
                answered += envelope.record_count
            elif envelope.kind == pb.MESSAGE_KIND_ACK:
                ack = codec.decode_payload(envelope, frames[1])
                assert isinstance(ack, pb.Ack)
                refused += len(ack.nacks)
    elapsed = time.perf_counter() - start
    cpu_after, _ = cpu_seconds(peer.proc.pid)
    return {
        "records_per_s": answered / elapsed,
        "answered": answered,
        "refused": refused,
        "seconds": elapsed,
        "cores": (cpu_after - cpu_before) / elapsed,
    }


class PssPeak:
    """The highest total PSS of a process tree, sampled every 20 ms on a thread while in the ``with``.

    Summing each process's peak RSS counts every shared page once per process that maps it: the Python
    and numpy libraries the forkserver and the CPU worker share with the gateway, and the CPU stage's
    shared-memory arena, which both sides map. PSS splits a shared page among its sharers.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.peak_mb = max(self.peak_mb, _tree_mb(self.pid, "smaps_rollup", "Pss:"))
            if self._stop.wait(0.02):
                return


def _tree_mb(pid: int, file: str, field: str) -> float:
    """A kB field of /proc/<pid>/<file>, summed over the process and its descendants, in MiB."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/{file}").read_text().splitlines():
                if line.startswith(field):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _reset_peak_rss(pid: int) -> None:
    """Restart VmHWM counting for the process tree (Linux: "5" to clear_refs), so that the peak read
    afterwards is the stress run's, not the throughput runs' before it."""
    for p in process_tree(pid):
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")
        except OSError:
            continue


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of the process and its descendants (the CPU workers), MiB."""
    return _tree_mb(pid, "status", "VmHWM:")


def stress(peer: Peer, requests: list[pb.InferRequest], n: int = 10_000, batch: int = 100) -> dict[str, Any]:
    """``n`` requests sent at once; waits (bounded) until each is answered or refused."""
    codec = FrameCodec()
    tracker = Tracker(codec, True)
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    _reset_peak_rss(peer.proc.pid)
    with PssPeak(peer.proc.pid) as pss:
        start = time.perf_counter()
        for offset in range(0, n, batch):
            chunk = [requests[(offset + i) % len(requests)] for i in range(batch)]
            copies = []
            for request in chunk:
                copy = pb.InferRequest()
                copy.CopyFrom(request)
                copies.append(copy)
            restamp(copies, 60.0)
            frames = codec.encode(
                pb.RequestBatch(requests=copies), agent_id="bench", region="us-west", features=FEATURES
            )
            tracker.sent(frames, copies, time.perf_counter())
            peer.sock.send_multipart(frames, copy=False)
        deadline = time.perf_counter() + 120
        while tracker.in_flight and time.perf_counter() < deadline:
            if poller.poll(200):
                drain(peer, tracker)
    refused = sum(tracker.nacks.values()) + sum(v for k, v in tracker.statuses.items() if k != pb.STATUS_OK)
    return {
        "requests": n,
        "ok": tracker.statuses.get(pb.STATUS_OK, 0),
        "refused": refused,
        "refusals": {
            **dict(tracker.nacks),
            **{
                pb.Status.Name(cast(pb.Status.ValueType, k)): v
                for k, v in tracker.statuses.items()
                if k != pb.STATUS_OK
            },
        },
        "lost": len(tracker.sent_at),
        "seconds": time.perf_counter() - start,
        "gateway_peak_rss_mb": _peak_rss_mb(peer.proc.pid),
        "gateway_peak_pss_mb": pss.peak_mb,
    }


def agent_stress(
    gateway: Peer, requests: list[pb.InferRequest], work: Path, n: int = 10_000, chunk: int = 100
) -> dict[str, Any]:
    """``n`` requests handed to a real edge agent at once (``n / chunk`` concurrent ``infer_many`` calls
    of a local service), through it to the gateway: each answered or refused, none lost (a request the
    agent never answers comes back from EdgeClient as "no answer"); peak RSS of agent and gateway."""

    async def run() -> list[pb.InferResponse]:
        async with EdgeClient(intake, service="stress") as client:
            copies = []
            for i in range(n):
                request = pb.InferRequest()
                request.CopyFrom(requests[i % len(requests)])
                request.request_id = b""
                copies.append(request)
            calls = [client.infer_many(copies[i : i + chunk], deadline_s=60) for i in range(0, n, chunk)]
            return [r for answers in await asyncio.gather(*calls) for r in answers]

    with running_agent(work, "stress", gateway.endpoint, 100, 2.0) as (intake, agent):
        _reset_peak_rss(gateway.proc.pid)
        start = time.perf_counter()
        with PssPeak(gateway.proc.pid) as gateway_pss, PssPeak(agent.pid) as agent_pss:
            answers = asyncio.run(run())
        seconds = time.perf_counter() - start
        agent_rss = _peak_rss_mb(agent.pid)
    statuses = Counter(pb.Status.Name(r.status) for r in answers)
    lost = sum(1 for r in answers if r.error_message == NO_ANSWER) + n - len(answers)
    return {
        "requests": n,
        "ok": statuses.get("STATUS_OK", 0),
        "refused": sum(v for k, v in statuses.items() if k != "STATUS_OK") - lost,
        "statuses": dict(statuses),
        "lost": lost,
        "seconds": seconds,
        "agent_peak_rss_mb": agent_rss,
        "agent_peak_pss_mb": agent_pss.peak_mb,
        "gateway_peak_pss_mb": gateway_pss.peak_mb,
        "gateway_peak_rss_mb": _peak_rss_mb(gateway.proc.pid),
    }


def plots(latency: list[dict[str, Any]]) -> list[Path]:
    """Latency CDF per tier (highest gateway rate) and answered vs offered rate; PNGs under docs/bench."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    written = []
    gateway = [r for r in latency if not r["peer"].startswith("echo")]
    top = max(gateway, key=lambda r: r["rate"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for tier, values in sorted(top["by_tier_ms"].items()):
        xs = np.sort(values)
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{tier} ({len(xs)})")
    echo = [r for r in latency if r["peer"].startswith("echo") and r["rate"] == top["rate"]]
    if echo:
        xs = np.sort(echo[0]["latencies_ms"])
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), "k--", label="raw DEALER/ROUTER echo")
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms (log)")
    ax.set_ylabel("share of requests")
    ax.set_title(f"Realtime requests, open loop at {top['rate']:g}/s")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    path = PLOTS / "latency_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({r["peer"] for r in latency}):
        runs = sorted((r for r in latency if r["peer"] == name), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in runs], [r["answered_per_s"] for r in runs], "o-", label=name)
    ax.plot([0, max(RATES)], [0, max(RATES)], ":", color="grey", label="offered")
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("answered requests/s")
    ax.legend()
    ax.grid(True, alpha=0.3)
    path = PLOTS / "throughput_vs_offered.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def render(result: dict[str, Any], seconds: float, repeats: int) -> str:
    ingest = result["ingest"]
    gw = ingest["gateway"]
    via_agent = result["agent_stress"]["ok"] / result["agent_stress"]["seconds"]
    rows = [
        [
            f"hk-gateway, frames of 100 (answered; gateway used {ingest['gateway_cores']:.2f} cores)",
            f"{gw:,.0f} (median of {len(ingest['gateway_runs'])}: "
            + " / ".join(f"{r:,.0f}" for r in ingest["gateway_runs"])
            + ")",
            "-",
        ],
        [
            "hk-gateway, driver encoding each frame and decoding each answer on the same cores",
            f"{ingest['gateway_driver_encoding']:,.0f}",
            f"{gw / ingest['gateway_driver_encoding']:.2f}x",
        ],
        [
            "local service -> edge-agent intake -> gateway -> answers (the 10k run below)",
            f"{via_agent:,.0f}",
            f"{gw / via_agent:.2f}x",
        ],
        [
            "minimal Python ingest, frames of 100: decode, dedupe, ack, empty answers; no routing, batching, "
            "pipelines or metrics (bench/minimal_ingest.py; one run)",
            f"{ingest['minimal']['records_per_s']:,.0f} ({ingest['minimal']['records']:,} records in "
            f"{ingest['minimal']['seconds']:.1f} s)",
            f"{gw / ingest['minimal']['records_per_s']:.2f}x",
        ],
        ["raw pyzmq PUSH/PULL, 1 per frame", f"{ingest['pyzmq']:,.0f}", f"{gw / ingest['pyzmq']:.2f}x"],
        [
            "grpcio bidirectional stream, 1 per message",
            f"{ingest['grpc']:,.0f}",
            f"{gw / ingest['grpc']:.2f}x",
        ],
        ["HTTP/JSON, 1 POST per request", f"{ingest['http']:,.0f}", f"{gw / ingest['http']:.2f}x"],
    ]
    echo = {r["rate"]: r for r in result["latency"] if r["peer"].startswith("echo")}
    lat_rows = []
    for r in result["latency"]:
        if r["peer"].startswith("echo"):
            continue
        base = echo.get(r["rate"])
        over50 = (r["p50_ms"] - base["p50_ms"]) * 1000 if base else float("nan")
        over99 = (r["p99_ms"] - base["p99_ms"]) if base else float("nan")
        lat_rows.append(
            [
                f"{r['rate']:g}/s",
                f"{r['answered_per_s']:,.0f}",
                f"{r['p50_ms']:.2f} / {base['p50_ms'] if base else float('nan'):.2f}",
                f"{r['p99_ms']:.2f} / {base['p99_ms'] if base else float('nan'):.2f}",
                f"{over50:,.0f} us",
                f"{over99:.2f} ms",
                str(r["lost"]),
                " / ".join(f"{v:.2f}" for v in r["p99_ms_runs"]),
            ]
        )
    s = result["stress"]
    a = result["agent_stress"]
    goals = [
        ["ingest >= 150k records/s", f"{gw:,.0f}/s", "met" if gw >= 150_000 else "not met"],
        [
            ">= 2.0x raw pyzmq 1 per frame",
            f"{gw / ingest['pyzmq']:.2f}x",
            "met" if gw >= 2 * ingest["pyzmq"] else "not met",
        ],
        [
            ">= 10x grpcio per message",
            f"{gw / ingest['grpc']:.2f}x",
            "met" if gw >= 10 * ingest["grpc"] else "not met",
        ],
    ]
    at2k = next(
        (r for r in result["latency"] if r["rate"] == 2000 and not r["peer"].startswith("echo")), None
    )
    if at2k is not None and 2000 in echo:
        o50 = (at2k["p50_ms"] - echo[2000]["p50_ms"]) * 1000
        o99 = at2k["p99_ms"] - echo[2000]["p99_ms"]
        goals.append(["overhead p50 <= 150 us at 2k/s", f"{o50:,.0f} us", "met" if o50 <= 150 else "not met"])
        goals.append(["overhead p99 <= 2 ms at 2k/s", f"{o99:.2f} ms", "met" if o99 <= 2 else "not met"])
    lost = s["lost"] + a["lost"]
    goals.append(
        [
            "10k in flight: 0 lost",
            f"{s['lost']} / {a['lost']} (direct / via agent)",
            "met" if lost == 0 else "not met",
        ]
    )
    limit_mib = 500 * 1e6 / 2**20  # 500 MB
    for label, run in (
        ("gateway RSS <= 500 MB in the 10k run (fresh gateway; summed peaks, the stricter)", s),
        ("the same after every other run filled its caches (through the agent, last)", a),
    ):
        rss, pss = run["gateway_peak_rss_mb"], run["gateway_peak_pss_mb"]
        goals.append(
            [
                label,
                f"{rss:.0f} MiB summed VmHWM, {pss:.0f} MiB PSS",
                "met" if rss <= limit_mib else "not met" + (" (PSS under)" if pss <= limit_mib else ""),
            ]
        )
    return f"""## Whole path: ingest, latency, 10k in flight (issue 9)

`python -m bench.ingest_bench --seconds {seconds:g} --repeats {repeats} --write` ({stamp()}; {machine()}).
Driver, gateway and baseline servers share the machine's two cores. The gateway's ingest rate is the
median of {repeats} runs of {seconds:g} s (each shown); latency percentiles pool {repeats} runs per rate.
The gateway runs the null backend (CPU stage, routing, batching and replies as in production; the model
costs nothing).

Ingest, records/s (same serialized requests everywhere; the gateway figure counts responses received):

{table(["path", "records/s", "gateway vs it"], rows)}

Open-loop realtime latency, one request per frame (gateway / raw DEALER-ROUTER echo at the same rate;
overhead = the difference at that percentile; each run's own gateway p99 in the last column):

{table(LATENCY_HEADER, lat_rows)}

10,000 requests in flight at once, two ways:
- straight to the gateway (100 frames of 100 from one DEALER): {s["ok"]:,} answered OK, {s["refused"]:,}
  refused explicitly {s["refusals"] or ""}, **{s["lost"]} lost**, all settled in {s["seconds"]:.1f} s;
- through a real edge agent (`edge-agent` process, 100 concurrent `EdgeClient.infer_many` calls of 100 from
  a local service): {a["ok"]:,} answered OK, {a["refused"]:,} refused explicitly {a["statuses"]},
  **{a["lost"]} lost**, settled in {a["seconds"]:.1f} s.

Memory at each 10k run's peak (peaks reset before each), gateway with its CPU worker and forkserver, as
PSS (sampled every 20 ms; shared pages split among the processes that map them) and as the sum of each
process's VmHWM (the Python libraries and the CPU arena, mapped by several processes, counted once per
process): fresh gateway, the direct run first, {s["gateway_peak_pss_mb"]:.0f} MiB PSS /
{s["gateway_peak_rss_mb"]:.0f} MiB; the run through the agent, last, after the ingest and latency runs
have filled the response cache (64 MiB by default) and the dedupe window as in production,
{a["gateway_peak_pss_mb"]:.0f} MiB PSS / {a["gateway_peak_rss_mb"]:.0f} MiB. Edge agent:
{a["agent_peak_pss_mb"]:.0f} MiB PSS, {a["agent_peak_rss_mb"]:.0f} MiB VmHWM.

Against the issue's figures:

{table(["figure", "measured", ""], goals)}

Plots: [latency CDF per tier](bench/latency_cdf.png), [answered vs offered](bench/throughput_vs_offered.png).

{ANALYSIS}
"""


ANALYSIS = """Runs on this shared two-core machine vary from one to the next, by a third at busy times:
the same command on 2026-11-30 gave a gateway median of 10,973 (08:34 UTC), 11,628 (08:46), 10,025
(08:57) and 7,195 records/s (09:35, when its baselines fell as well: raw pyzmq 338k -> 266k, the replay
bench's raw sink 30k -> 19k). Hence the median of several runs here; compare figures from the same run.

What changed since the first measurement (same command, 2026-11-30 05:26 UTC, one run: gateway
6,420 records/s with the driver encoding on the same cores, 1.11x grpcio; realtime p50 overhead 713 us / p99
33 ms at 500/s, 3.5 ms / 21.6 ms at 2000/s; 329 MiB summed VmHWM), each found by profiling the gateway
under this load (py-spy, cProfile):

1. Carriers read their ROUTER from the loop's reader callback on a plain socket view instead of
   zmq.asyncio (a Future, a task wake-up and enum conversions per message); sends are plain non-blocking
   sends. Time in the gateway for a lone realtime request: p50 578 -> 482 us.
2. Ranking features: `candidate_dense`/`user_dense` read as packed bytes through a reading view
   (proto/edgeinfer/v1/views.proto) with `np.frombuffer`, not float by float (17 -> 1.5 us per request);
   tensor dtype lookup without `dtype.name` (2.4 us per tensor).
3. The CPU stage's data leaves the pipe: a shared-memory arena (inference/pipeline/arena.py) carries each
   batch's requests to the worker and its input tensors back (pickling and pipe transfers were ~28% of the
   gateway's samples); `finish` gets item ids and top_k from `prepare`, not the requests a second time.
4. The CPU workers are fed from the event loop through one pipe each (gateway/dispatch/workers.py)
   instead of ProcessPoolExecutor, whose manager and feeder threads need the GIL for every hand-off: the
   loop held it and the worker idled with work queued.
5. Per-frame instead of per-request metric updates; queue, in-flight and dedupe gauges read at scrape.
6. A carrier wake-up reads for at most ~2 ms, so a burst of large frames does not hold up the workers'
   answers (and so the workers).
7. The edge agent (the row through it, and bench/agent_bench.py): Hong Kong's answers went to the local
   caller one intake frame each (zmq.asyncio send, spool ack) and now go once per loop tick per caller
   (up to 256 a frame); batch fsyncs run on a thread with frames arriving meanwhile sharing the next
   (group commit; the loop no longer waits on the disk); the agent runs on uvloop. Alternating runs of
   old and new code: agent_bench batched 6,447 / 6,281 -> 8,003 / 6,769 records/s; the 10k burst
   through the agent, three runs each, 4.7k / 5.2k / 4.5k/s -> 5.5k / 4.9k / 6.0k/s.
8. The pool batcher is a loop callback (a pass per submit tick, per finished batch, or a timer) instead of
   a task woken through an Event and a semaphore, and carriers ask ZMQ_EVENTS before receiving instead
   of catching EAGAIN. Neither shows above the noise: five alternating runs at 1000 realtime requests/s,
   gateway main-thread CPU per request 653 us before, 628 us after (averages); ingest three runs each,
   medians 10.7k before, 10.9k after.
9. Both programs freeze their start-up heap once started (`gc.freeze`, service/runtime.py): a full
   collection scanned the ~80k objects of imports, models and config, ~40 ms with the loop stopped, and
   now takes ~1 ms (gc callbacks in the gateway after a load run). It changes no throughput: in a 5 s
   ingest run the collector ran ~100 young collections, ~45 ms in all, either way.
10. Ranking `finish` ranks a whole batch in one stable sort by (request, score) instead of a partition and
    a sort per request (~10 numpy calls each), and `prepare` joins the batch's packed dense features and
    counts its tags in one call each: per request in one process, finish 17.5 -> 5.8 us and prepare
    33.7 -> 29.1 us (batches of 100). The ingest rate, two alternating runs of three each, old code
    11.6k / 11.1k / 11.0k and 10.2k / 9.2k / 10.6k, new code 12.9k / 12.5k / 12.8k and 12.8k / 12.0k /
    12.3k records/s.
11. Tensor batches run on the event loop at any size (no worker round trip for bytes that are only copied),
    and frames zstd shrinks by less than 10% travel uncompressed; neither changes the throughput run (no
    tensor requests; batches of 100 and the null backend's zero outputs compress well; only the latency
    runs' single short text requests now travel raw): see the GPU tier's harness check. All of this
    session's changes together, two alternating runs of three each: old code 11.4k / 11.2k / 11.6k and
    11.5k / 11.1k / 11.0k, new 13.3k / 13.0k / 12.7k and 13.7k / 13.1k / 13.2k records/s.

What limits it now: the gateway process's one thread. Under this load (per-thread CPU from /proc,
2026-11-30 12:20 UTC) the loop uses 0.75 of a core, the CPU worker 0.5, the machine is ~75% busy: ~70 us
of the loop's CPU per request. Timed per call with thread CPU clocks: screening a request ~4 us, routing
it and queueing it ~21 us (profile + decision ~10, WorkItem and pool submit ~6), decoding ~5 us,
answering ~12 us (the response and its metrics), the reply frame ~5 us; the rest is per batch: a frame of
100 mixed requests becomes ~4 batches (ranking, text per length bucket, the few long requests routed to
the cloud pools; 1,551 batches for 40,000 requests, ~26 each, those of the cloud pools ~2 each), each with
a task, two worker round trips (pickled task and answer), arena bookkeeping and a backend call. 150k
records/s on two cores leaves 13 us of CPU per record for everything. Python itself is not the floor:
the minimal ingest row (one process: the same codec checks and decode, a dedupe set, the Ack and an
empty answer per request, with this driver and these frames) shows what is left when the gateway's
features are gone. What the gateway adds per request is the cost: the routing profile and decision, a
WorkItem in a pool queue, batching, the CPU stage's pipeline (~29 us of feature assembly and ~6 us of
top-k per ranking request in the worker, ~10 us of it in the Rust tokenizer per text request),
per-request answers and metrics. Reaching 150k/s with them needs that work per group of a frame instead
of per request (requests kept as serialized bytes end to end, routing and queueing per group, answers
assembled from worker-written bytes) and the pipelines on more cores than two, or compiled. The latency
target meets the same wall: a lone realtime request costs the gateway 430-810 us of CPU (measured from
/proc at 2000/s .. 500/s: decode, route, ack, prepare, infer, finish, answer, two ZeroMQ sends of ~25 us
CPU each; each step costs two to four times its cost inside a busy batch, its code and data no longer in
the CPU's caches), so 2000 single-request frames a second keep its loop nearly saturated and its p99 is
queueing. Sending those small batches to the idle CPU worker instead (`[cpu] inline_max_requests = 0`)
saves the loop little (~600 -> ~570 us per request at 1000/s: the hand-off costs about what the pipeline
did) and puts p50 at 10-13 ms. Sending each Ack with its loop tick's responses instead of at once (one
wake-up of ZeroMQ's I/O thread per burst) was measured too and not kept: ingest within noise (medians of
two alternating triples: 13.0k / 12.1k before, 11.6k / 12.6k with it), realtime p50 at 500/s 0.79 / 0.81
-> 0.94 / 0.94 ms. Those are changes of the whole ingest path, not tuning; this command is the gauge for
them.

Memory: the 10k run on a fresh gateway stays well under 500 MB. After the other runs (three ingest runs,
the latency runs) the dedupe window holds ~300k ids (~134 bytes each), the response cache is at its
64 MiB bound, and more arena slots have been touched; the summed VmHWM, which counts the shared
libraries once per process (gateway, CPU worker, forkserver), then comes near 500 MB while PSS stays
well under it. (The response cache's bound now counts each answer's ~190 bytes of bookkeeping; before,
a "64 MiB" cache of ranking answers held ~85 MiB, and this figure was 494 MiB in a run earlier today.)
In production the dedupe window's bound (`dedupe.max_entries`, 2M ids ~ 270 MB) and the response cache
dominate steady-state memory: size them for the RSS budget (docs/GATEWAY.md)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="gateway ingest and latency runs (median, pooled)"
    )
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    requests = workload(2000, seed=9)
    payloads = [r.SerializeToString() for r in requests]
    documents = [json_format.MessageToJson(r, indent=None) for r in requests[:500]]
    result: dict[str, Any] = {"ingest": {}}
    result["ingest"]["pyzmq"] = baselines.pyzmq_push_pull(payloads, args.seconds)
    result["ingest"]["grpc"] = baselines.grpc_stream(payloads, args.seconds)
    result["ingest"]["http"] = baselines.http_json(documents, args.seconds)
    repeats = args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        gateway = start_gateway(Path(tmp), "null")
        try:
            time.sleep(1.0)
            result["stress"] = stress(gateway, requests)  # first: a fresh gateway's memory
            ingest(gateway, prebuild(requests, 20), 1.0)  # warm: workers, arena, routing calibration
            runs = []
            for _ in range(repeats):
                # Enough frames for a run at well above today's rate, encoded (fresh ids) before it
                # starts; bounded: 150k records, ~115 MB, built per run so only one run's are held.
                frames = prebuild(requests, min(1500, int(30_000 * args.seconds / 100)))
                runs.append(ingest(gateway, frames, args.seconds))
                del frames
            rates = sorted(r["records_per_s"] for r in runs)
            result["ingest"]["gateway"] = float(np.median(rates))
            result["ingest"]["gateway_runs"] = rates
            result["ingest"]["gateway_cores"] = float(np.median([r["cores"] for r in runs]))
            result["ingest"]["gateway_driver_encoding"] = throughput(
                gateway, requests, args.seconds, True
            ).records_per_s
            result["latency"] = [
                open_loop_repeated(gateway, requests, rate, args.seconds, repeats) for rate in RATES
            ]
            result["agent_stress"] = agent_stress(gateway, requests, Path(tmp))
        finally:
            gateway.close()
        result["ingest"]["minimal"] = minimal_ingest(requests, args.seconds)
        echo = Peer("echo (raw DEALER/ROUTER)", [sys.executable, "-m", "bench.echo"], ready="stdout")
        try:
            result["latency"] += [
                open_loop_repeated(echo, requests, rate, args.seconds, repeats) for rate in RATES
            ]
        finally:
            echo.close()
    summary = {k: v for k, v in result.items() if k != "latency"}
    summary["latency"] = [
        {k: v for k, v in r.items() if k not in ("latencies_ms", "by_tier_ms")} for r in result["latency"]
    ]
    print(json.dumps(summary, indent=2) if args.json else render(result, args.seconds, repeats))
    if args.write:
        plots(result["latency"])
        update_section("ingest", render(result, args.seconds, repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
