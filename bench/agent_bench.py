"""Edge agent throughput: records/s from local intake to the gateway's ack, batched vs unbatched.

    python -m bench.agent_bench [--seconds 5] [--write]

A gateway (null backend) and an edge agent run as separate processes; this process feeds the agent's
intake with batch-class synthetic requests (so every one is spooled, fsync per batch, then sent) through
``EdgeClient`` and reads the gateway's ``hkgw_requests_accepted_total`` to count what Hong Kong accepted.
Unbatched = ``batching.max_records = 1`` (one request per frame), the baseline of the same run.

Beside records/s it reports the CPU each process spent per record the gateway accepted over the timed
window (utime + stime from /proc): the agent's process tree, the gateway's, and this driver's (its
ZeroMQ I/O thread included). On a machine whose cores the three share, CPU per record is the figure that
compares two versions of the agent; records/s follows whoever has the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gateway_bench import cpu_seconds, start_gateway
from bench.report import machine, stamp, table, update_section
from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.testing_servers import free_port

AGENT_TOML = """
region = "us-west"
intake = "tcp://127.0.0.1:{intake}"
[[carriers]]
name = "hgc"
endpoint = "{endpoint}"
[local]
enabled = false
[spool]
directory = "{spool}"
fsync = "batch"
[batching]
max_records = {max_records}
linger_ms = {linger_ms}
[uplink]
max_inflight = 50000
ping_interval_s = 0.2
[http]
port = 0
"""


@dataclass
class AgentRun:
    mode: str
    accepted: int
    seconds: float
    records_per_s: float
    frames_per_record: float
    agent_us: float  # CPU per record accepted, microseconds: the agent's process tree
    gateway_us: float  # the gateway's process tree
    driver_us: float  # this process (the EdgeClient feeding the intake)


def accepted(http_port: int) -> tuple[float, float]:
    """(requests accepted, request-batch frames received) at the gateway, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    acc = sum(float(m) for m in re.findall(r"^hkgw_requests_accepted_total\{[^}]*\} (\S+)$", body, re.M))
    frames = sum(
        float(m)
        for m in re.findall(
            r'^hkgw_frames_received_total\{[^}]*kind="request_batch"[^}]*\} (\S+)$', body, re.M
        )
    )
    return acc, frames


async def feed(intake: str, requests: list[pb.InferRequest], seconds: float) -> None:
    """Push batch-class requests into the intake for ``seconds`` (bounded), 50 per intake frame."""
    end = time.monotonic() + seconds
    async with EdgeClient(intake, service="bench") as client:
        pending: set[asyncio.Task[list[pb.InferResponse]]] = set()
        i = 0
        while time.monotonic() < end:
            chunk = []
            for _ in range(50):
                request = pb.InferRequest()
                request.CopyFrom(requests[i % len(requests)])
                request.request_id = b""
                request.priority = pb.PRIORITY_CLASS_BATCH
                chunk.append(request)
                i += 1
            pending.add(asyncio.create_task(client.infer_many(chunk, deadline_s=60)))
            if len(pending) >= 40:  # bounded: at most 2000 requests waiting in this driver
                _done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()


def run_mode(
    work: Path,
    gateway: tuple[int, int, str],
    mode: str,
    seconds: float,
    requests: list[pb.InferRequest],
) -> AgentRun:
    """One agent for ``mode``, fed for ``seconds``; ``gateway`` is (its pid, HTTP port, carrier endpoint)."""
    gateway_pid, gateway_http, endpoint = gateway
    intake = free_port()
    max_records, linger = (100, 2.0) if mode == "batched" else (1, 0.0)
    config = work / f"agent-{mode}.toml"
    config.write_text(
        AGENT_TOML.format(
            intake=intake,
            endpoint=endpoint,
            spool=work / f"spool-{mode}",
            max_records=max_records,
            linger_ms=linger,
        )
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "edge_agent", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2.0)  # the agent's start-up (imports, first pongs); measured from the first accepts on
        before, frames_before = accepted(gateway_http)
        cpu_before = [cpu_seconds(pid)[0] for pid in (agent.pid, gateway_pid, os.getpid())]
        started = time.monotonic()
        asyncio.run(feed(f"tcp://127.0.0.1:{intake}", requests, seconds))
        elapsed = time.monotonic() - started
        cpu_after = [cpu_seconds(pid)[0] for pid in (agent.pid, gateway_pid, os.getpid())]
        after, frames_after = accepted(gateway_http)
    finally:
        agent.terminate()
        agent.wait(30)
    got = int(after - before)
    agent_us, gateway_us, driver_us = (
        (a - b) * 1e6 / max(got, 1) for a, b in zip(cpu_after, cpu_before, strict=True)
    )
    return AgentRun(
        mode,
        got,
        elapsed,
        got / elapsed,
        (frames_after - frames_before) / max(got, 1),
        agent_us,
        gateway_us,
        driver_us,
    )


def render(runs: list[AgentRun], args: argparse.Namespace) -> str:
    base = next((r for r in runs if r.mode == "unbatched"), None)
    rows = [
        [
            r.mode,
            f"{r.accepted:,}",
            f"{r.records_per_s:,.0f}",
            "baseline" if base is None or r is base else f"{r.records_per_s / base.records_per_s:.2f}x",
            f"{r.frames_per_record:.3f}",
            f"{r.agent_us:.0f}",
            f"{r.gateway_us:.0f}",
            f"{r.driver_us:.0f}",
        ]
        for r in runs
    ]
    return "\n".join(
        [
            "## Edge agent: local intake to gateway ack (issue 5)",
            "",
            f"Command: `python -m bench.agent_bench --seconds {args.seconds:g} --write`  ",
            f"Measured {stamp()} on {machine()}.",
            "Gateway (null backend), agent and driver are separate processes on this machine. Batch-class",
            "requests, spooled with fsync per batch before the intake acks them. The gateway's per-frame",
            "cost bounds the unbatched run. CPU per record: CPU seconds (utime + stime from /proc) each",
            "process tree used over the timed window, per record the gateway accepted, in microseconds; the",
            "three share the machine's cores, so this, not records/s, is what compares two versions.",
            "",
            table(
                [
                    "agent batching",
                    "accepted by the gateway",
                    "records/s",
                    "vs unbatched",
                    "frames per record",
                    "agent CPU us/record",
                    "gateway CPU us/record",
                    "driver CPU us/record",
                ],
                rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="edge agent: intake to gateway ack, batched vs unbatched")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("unbatched", "batched"),
        default=["unbatched", "batched"],
        help="which runs (--write needs both: unbatched is the baseline)",
    )
    args = parser.parse_args(argv)
    if args.write and len(set(args.modes)) < 2:
        parser.error("--write needs both modes")
    requests = [
        r.request
        for r in SyntheticTraffic(4, regions=("us-west",)).take(3000)
        if r.request.kind != pb.REQUEST_KIND_IMAGE
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gateway = start_gateway(work, "null")
        try:
            where = (gateway.proc.pid, gateway.http_port, gateway.endpoint)
            runs = [run_mode(work, where, mode, args.seconds, requests) for mode in args.modes]
        finally:
            gateway.close()
    print(json.dumps([asdict(r) for r in runs], indent=2) if args.json else render(runs, args))
    if args.write:
        update_section("agent", render(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
