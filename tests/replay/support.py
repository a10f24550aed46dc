"""Making and replaying capture cases: synthetic traffic captured by a real gateway, golden decisions.

A routing decision must not depend on timing for a golden comparison to be exact, so the gateways here run
with pool queues too deep to saturate, latency calibration off, and requests carry generous deadlines.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.testing import WireClient, fresh_requests, run_gateway
from routing.config import DEFAULT_ROUTING_SECTION


def replay_routing(**changes: Any) -> dict[str, Any]:
    """The default routing policy, with queues that never fill and calibration off (plus ``changes``)."""
    routing = copy.deepcopy(DEFAULT_ROUTING_SECTION)
    for pool in routing["pools"]:
        pool["max_queue_depth"] = 100_000
    routing["calibration"] = {"enabled": False}
    routing.update(changes)
    return routing


def gateway_overrides(capture_dir: Path | None = None, **routing_changes: Any) -> dict[str, Any]:
    overrides: dict[str, Any] = {"routing": replay_routing(**routing_changes)}
    if capture_dir is not None:
        overrides["capture"] = {"enabled": True, "directory": str(capture_dir), "flush_interval_s": 0.1}
    return overrides


async def capture_synthetic(
    models_dir: Path, capture_dir: Path, requests: int, seed: int, *, per_frame: int = 8, rate: float = 400.0
) -> int:
    """Send synthetic traffic of every region through a capturing gateway; returns requests answered OK."""
    traffic = [r for r in SyntheticTraffic(seed).take(requests)]
    by_region: dict[str, list[pb.InferRequest]] = {}
    for item in traffic:
        by_region.setdefault(item.region, []).append(item.request)
    ok = 0
    async with run_gateway(models_dir=models_dir, **gateway_overrides(capture_dir)) as gw:
        clients = {
            region: WireClient(gw.endpoint(carrier), agent_id=f"edge-{region}-1", region=region)
            for region, carrier in zip(sorted(by_region), ["hgc", "pccw", "tgt"] * 3, strict=False)
        }
        for client in clients.values():
            await client.__aenter__()
        try:
            sent: list[tuple[WireClient, bytes]] = []
            started = time.monotonic()
            frames = [
                (region, chunk[i : i + per_frame])
                for region, chunk in by_region.items()
                for i in range(0, len(chunk), per_frame)
            ]
            frames.sort(key=lambda f: f[1][0].request_id)  # interleave regions as the generator did
            for n, (region, chunk) in enumerate(frames):
                due = started + n * per_frame / rate
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
                batch = fresh_requests(chunk, budget_s=10.0)
                await clients[region].send(batch)
                sent.extend((clients[region], r.request_id) for r in batch)
            for client in clients.values():
                mine = [rid for c, rid in sent if c is client]
                responses = await client.wait_responses(mine, timeout_s=60)
                ok += sum(r.status == pb.STATUS_OK for r in responses)
        finally:
            for client in clients.values():
                await client.__aexit__(None, None, None)
    return ok
