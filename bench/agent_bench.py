"""Edge agent throughput: records/s from local intake to the gateway's ack, batched vs unbatched.

    python -m bench.agent_bench [--seconds 5] [--write]

A gateway (null backend) and an edge agent run as separate processes; this process feeds the agent's
intake with batch-class synthetic requests (so every one is spooled, fsync per batch, then sent) through
``EdgeClient`` and reads the gateway's ``hkgw_requests_accepted_total`` to count what Hong Kong accepted.
Unbatched = ``batching.max_records = 1`` (one request per frame), the baseline of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gateway_bench import start_gateway
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
    work: Path, gateway_http: int, endpoint: str, mode: str, seconds: float, requests: list[pb.InferRequest]
) -> AgentRun:
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
        started = time.monotonic()
        asyncio.run(feed(f"tcp://127.0.0.1:{intake}", requests, seconds))
        elapsed = time.monotonic() - started
        after, frames_after = accepted(gateway_http)
    finally:
        agent.terminate()
        agent.wait(30)
    got = int(after - before)
    return AgentRun(mode, got, elapsed, got / elapsed, (frames_after - frames_before) / max(got, 1))


def render(runs: list[AgentRun], args: argparse.Namespace) -> str:
    base = next(r for r in runs if r.mode == "unbatched")
    rows = [
        [
            r.mode,
            f"{r.accepted:,}",
            f"{r.records_per_s:,.0f}",
            "baseline" if r is base else f"{r.records_per_s / base.records_per_s:.2f}x",
            f"{r.frames_per_record:.3f}",
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
            "cost bounds the unbatched run.",
            "",
            table(
                [
                    "agent batching",
                    "accepted by the gateway",
                    "records/s",
                    "vs unbatched",
                    "frames per record",
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
    args = parser.parse_args(argv)
    requests = [
        r.request
        for r in SyntheticTraffic(4, regions=("us-west",)).take(3000)
        if r.request.kind != pb.REQUEST_KIND_IMAGE
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gateway = start_gateway(work, "null")
        try:
            runs = [
                run_mode(work, gateway.http_port, gateway.endpoint, mode, args.seconds, requests)
                for mode in ("unbatched", "batched")
            ]
        finally:
            gateway.close()
    print(json.dumps([asdict(r) for r in runs], indent=2) if args.json else render(runs, args))
    if args.write:
        update_section("agent", render(runs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
