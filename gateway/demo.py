"""The main job of the README: a real gateway and realistic synthetic traffic, and what happened.

    python -m gateway.demo [--requests 3000] [--rate 1500]

Starts ``hk-gateway`` with no arguments (three loopback carriers, the embedded ONNX demo models), sends
synthetic cross-border traffic from every region through all three carriers with the wire codec (one
DEALER per region and carrier, as agents do), prints the outcome, then stops the gateway with SIGTERM and
shows that it drained. Until the edge agent lands, the regional side is this driver.
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

import aiohttp
import numpy as np

from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.testing import WireClient, fresh_requests

CARRIERS = ("hgc", "pccw", "tgt")
STATUS = {v: pb.Status.Name(v).removeprefix("STATUS_") for v in pb.Status.values()}
TIER = {v: pb.Tier.Name(v).removeprefix("TIER_").lower() for v in pb.Tier.values()}
KIND = {v: pb.RequestKind.Name(v).removeprefix("REQUEST_KIND_").lower() for v in pb.RequestKind.values()}


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


async def drive(endpoints: dict[str, str], n: int, rate: float, seed: int) -> dict[str, object]:
    generated = SyntheticTraffic(seed, rate_per_s=rate).take(n)
    clients: dict[tuple[str, str], WireClient] = {}
    for region in sorted({g.region for g in generated}):
        for carrier in CARRIERS:
            clients[(region, carrier)] = WireClient(
                endpoints[carrier], agent_id=f"demo-{region}", region=region
            )
    for client in clients.values():
        await client.__aenter__()
    sent_at: dict[bytes, float] = {}
    kinds: dict[bytes, str] = {}
    start = time.perf_counter()
    try:
        # Open loop at the synthetic arrival times; each region's requests rotate over the carriers.
        pending: dict[tuple[str, str], list[pb.InferRequest]] = {}
        for i, g in enumerate(generated):
            delay = start + g.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # open loop: the synthetic arrival time, not the last answer
            (request,) = fresh_requests([g.request], budget_s=g.budget_ms / 1000)
            key = (g.region, CARRIERS[i % len(CARRIERS)])
            pending.setdefault(key, []).append(request)
            sent_at[request.request_id] = time.perf_counter()
            kinds[request.request_id] = KIND[request.kind]
            if len(pending[key]) >= 8 or i == n - 1:  # agents batch a few requests per frame
                await clients[key].send(pending.pop(key))
        for key, rest in pending.items():
            await clients[key].send(rest)
        deadline = time.perf_counter() + 30
        while time.perf_counter() < deadline:
            answered = sum(len(c.responses) for c in clients.values())
            nacked = sum(len(a.nacks) for c in clients.values() for a in c.acks.values())
            if answered + nacked >= n:
                break
            for client in clients.values():
                await client.receive_one(0.001)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)
    elapsed = time.perf_counter() - start
    responses = {rid: r for c in clients.values() for rid, r in c.responses.items()}
    nacks = [n for c in clients.values() for a in c.acks.values() for n in a.nacks]
    return {
        "elapsed": elapsed,
        "responses": responses,
        "nacks": nacks,
        "sent": n,
        "kinds": kinds,
        "duplicates": sum(c.duplicate_responses for c in clients.values()),
    }


def summarise(result: dict[str, object]) -> str:
    responses = result["responses"]
    nacks = result["nacks"]
    kinds = result["kinds"]
    assert isinstance(responses, dict)
    assert isinstance(nacks, list)
    assert isinstance(kinds, dict)
    sent = int(str(result["sent"]))
    by_status = Counter(STATUS[r.status] for r in responses.values())
    by_route = Counter((TIER[r.tier], r.pool, r.route_reason) for r in responses.values())
    by_kind = Counter(kinds[rid] for rid in responses)
    server_ms = np.array([r.timing.total_us / 1000 for r in responses.values() if r.status == pb.STATUS_OK])
    lost = sent - len(responses) - len(nacks)
    lines = [
        f"sent {sent} requests in {float(str(result['elapsed'])):.1f} s over {len(CARRIERS)} carriers",
        f"answered {len(responses)}: " + ", ".join(f"{k} {v}" for k, v in by_status.most_common()),
        f"refused at ingest (nack) {len(nacks)}: "
        + (
            ", ".join(f"{pb.NackReason.Name(k)} {v}" for k, v in Counter(n.reason for n in nacks).items())
            or "none"
        ),
        f"lost {lost}, answered twice {result['duplicates']}",
        "by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())),
        "by tier / pool / reason:",
        *[
            f"  {tier:<12} {pool:<14} {reason:<22} {count}"
            for (tier, pool, reason), count in by_route.most_common()
        ],
    ]
    if len(server_ms):
        p50, p90, p99 = np.percentile(server_ms, [50, 90, 99])
        lines.append(f"gateway time (receipt to reply): p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms")
    return "\n".join(lines)


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
        result = await drive({k: str(v) for k, v in carriers.items()}, args.requests, args.rate, args.seed)
        print(summarise(result))
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
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=1500.0, help="offered requests per second")
    parser.add_argument("--seed", type=int, default=8)
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
