"""The main job of the README: a real gateway and realistic synthetic traffic, and what happened.

    python -m demo [--requests 3000] [--rate 1500]

Starts ``hk-gateway`` with no arguments (three loopback carriers, the embedded ONNX demo models), starts one
edge agent per region (each with its local tier, spool and uplink over all three carriers), feeds each its
region's share of realistic synthetic traffic through its intake, prints the outcome, then stops the gateway
with SIGTERM and shows that it drained.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np

from edge_agent.agent import EdgeAgent
from edge_agent.config import load_config as load_agent_config
from edge_agent.drive import DriveResult, drive
from edge_agent.synthetic import PROFILES

CARRIERS = ("hgc", "pccw", "tgt")


async def start_gateway() -> tuple[asyncio.subprocess.Process, dict[str, object]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--log-format",
        "json",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = await asyncio.wait_for(proc.stderr.readline(), 60)
        if not line:
            raise SystemExit("hk-gateway exited before it was ready")
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "gateway ready":
            return proc, record
    raise SystemExit("hk-gateway did not become ready")


async def drive_through_agents(
    endpoints: dict[str, str], n: int, rate: float, seed: int, workdir: Path
) -> list[tuple[str, DriveResult, dict[str, int]]]:
    """One real edge agent per region (local tier, spool, uplink over all carriers), each fed its region's
    share of the synthetic traffic through its intake, concurrently."""
    shares = {p.name: p.share for p in PROFILES}
    total = sum(shares.values())
    agents = []
    for region in shares:
        config = load_agent_config(
            environ={},
            overrides={
                "region": region,
                "intake": "tcp://127.0.0.1:*",
                "carriers": [{"name": name, "endpoint": endpoint} for name, endpoint in endpoints.items()],
                "local": {"repository": str(workdir / "models")},
                "spool": {"directory": str(workdir / "spool")},
                "http": {"port": 0},
            },
        )
        agent = EdgeAgent(config)
        await agent.start()
        agents.append(agent)
    try:
        for agent in agents:
            uplink = agent.uplink
            deadline = time.monotonic() + 10
            while uplink is not None and uplink.best() is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # polls the carriers' first pongs, with a deadline
        results = await asyncio.gather(
            *(
                drive(
                    a.intake_endpoint,
                    a.config.region,
                    max(1, round(n * shares[a.config.region] / total)),
                    rate * shares[a.config.region] / total,
                    seed,
                )
                for a in agents
            )
        )
        out = []
        for agent, result in zip(agents, results, strict=True):
            uplink = agent.uplink
            extra = {
                "served at the edge": agent.stats.local,
                "sent to Hong Kong": agent.stats.remote,
                "failed fast": sum(agent.stats.failed_fast.values()),
                "resent": sum(uplink.stats.resent.values()) if uplink else 0,
                "duplicate answers dropped": uplink.stats.duplicate_responses if uplink else 0,
            }
            out.append((agent.config.region, result, extra))
        return out
    finally:
        for agent in agents:
            await agent.aclose()


def summarise(results: list[tuple[str, DriveResult, dict[str, int]]]) -> str:
    lines = []
    totals: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    sent = lost = 0
    latencies: list[float] = []
    for region, result, extra in results:
        sent += result.sent
        lost += result.lost
        totals.update(result.by_status)
        routes.update(result.by_route)
        latencies.extend(result.latencies_ms)
        d = result.as_dict()
        lines.append(
            f"  {region:<15} sent {result.sent:>5}  lost {result.lost}  ok {result.by_status['OK']:>5}  "
            f"edge {extra['served at the edge']:>4}  to HK {extra['sent to Hong Kong']:>5}  "
            f"p50 {d['latency_ms']['p50']:>6} ms  p99 {d['latency_ms']['p99']:>7} ms"
        )
    p50, p90, p99 = np.percentile(np.array(latencies), [50, 90, 99]) if latencies else (0.0, 0.0, 0.0)
    head = [
        f"sent {sent} requests through {len(results)} edge agents (one per region); lost {lost}",
        "answered: " + ", ".join(f"{k} {v}" for k, v in totals.most_common()),
        "by tier / pool: " + ", ".join(f"{k} {v}" for k, v in routes.most_common()),
        f"caller latency: p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms",
        "per region:",
    ]
    return "\n".join(head + lines)


async def scrape(port: int, names: Sequence[str]) -> list[str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            body = await resp.text()
        health = []
        for carrier in CARRIERS:
            async with session.get(f"http://127.0.0.1:{port}/health/carriers/{carrier}") as resp:
                health.append(f"  /health/carriers/{carrier}: {resp.status} {(await resp.text()).strip()}")
    picked = [line for line in body.splitlines() if line.startswith(tuple(names))]
    return health + ["  " + line for line in picked]


async def main_async(args: argparse.Namespace) -> int:
    proc, ready = await start_gateway()
    carriers = ready["carriers"]
    assert isinstance(carriers, dict)
    port = int(str(ready["http_port"]))
    print(f"hk-gateway ready: carriers {carriers}, http :{port}")
    try:
        results = await drive_through_agents(
            {k: str(v) for k, v in carriers.items()}, args.requests, args.rate, args.seed, Path.cwd() / "var"
        )
        print(summarise(results))
        print("health and a few metrics:")
        print(
            "\n".join(
                await scrape(
                    port,
                    [
                        "hkgw_frames_received_total",
                        "hkgw_requests_accepted_total",
                        "hkgw_route_decisions_total",
                        "hkgw_cpu_worker_restarts",
                    ],
                )
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 60)
        print(f"SIGTERM: hk-gateway drained and exited with {code}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=300.0, help="offered requests per second, all regions")
    parser.add_argument("--seed", type=int, default=8)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
