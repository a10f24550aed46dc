"""``edge-agent --region R --synthetic N``: drive realistic synthetic traffic through a running agent path.

Open loop at ``--rate`` (the synthetic arrival times), through the real intake with ``EdgeClient``; the
summary says what was sent and answered, by status, tier and pool, with latency percentiles, and how many
requests were lost (no answer at all; must be 0).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticTraffic
from edgewire import labels, pb

STATUS = {value: label.upper() for value, label in labels.STATUS.items()}
TIER = labels.TIER
NO_ANSWER = "no answer from the edge agent in time"


@dataclass
class DriveResult:
    sent: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_route: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    lost: int = 0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        p50, p90, p99 = (round(float(x), 2) for x in np.percentile(lat, [50, 90, 99]))
        return {
            "sent": self.sent,
            "answered": dict(self.by_status),
            "by_tier_pool": dict(self.by_route),
            "latency_ms": {"p50": p50, "p90": p90, "p99": p99},
            "lost": self.lost,
            "elapsed_s": round(self.elapsed_s, 2),
        }

    def render(self) -> str:
        d = self.as_dict()
        lines = [
            f"sent {self.sent} in {d['elapsed_s']} s; lost {self.lost}",
            "answered: " + ", ".join(f"{k} {v}" for k, v in self.by_status.most_common()),
            "by tier / pool: " + ", ".join(f"{k} {v}" for k, v in self.by_route.most_common()),
            "latency ms (caller's view): p50 {p50}, p90 {p90}, p99 {p99}".format(**d["latency_ms"]),
        ]
        return "\n".join(lines)


async def drive(intake: str, region: str, n: int, rate: float, seed: int = 8) -> DriveResult:
    generated = SyntheticTraffic(seed, regions=(region,), rate_per_s=rate).take(n)
    result = DriveResult(sent=n)
    start = time.perf_counter()
    async with EdgeClient(intake, service="synthetic") as client:

        async def one(index: int) -> None:
            g = generated[index]
            request = pb.InferRequest()
            request.CopyFrom(g.request)
            request.request_id = b""
            sent = time.perf_counter()
            response = await client.infer(request, deadline_s=g.budget_ms / 1000)
            result.latencies_ms.append((time.perf_counter() - sent) * 1000)
            if response.error_message == NO_ANSWER:
                result.lost += 1
            result.by_status[STATUS.get(response.status, str(response.status))] += 1
            if response.status == pb.STATUS_OK:
                result.by_route[f"{TIER.get(response.tier, '?')}/{response.pool or '-'}"] += 1

        tasks = []
        for i, g in enumerate(generated):
            delay = start + g.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    result.elapsed_s = time.perf_counter() - start
    return result
