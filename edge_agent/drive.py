"""``edge-agent --region R --synthetic N``: drive realistic synthetic traffic through a running agent path.

Open loop at ``--rate`` (the synthetic arrival times), through the real intake with ``EdgeClient``; the
summary says what was sent and answered, by status, tier and pool, with latency percentiles, every
answer that was not OK by status and message, and how many requests were lost (no answer at all; must
be 0). ``DriveResult`` fills in while the run goes on, so a supervisor (the demo) can print progress.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticRequest, SyntheticTraffic
from edgewire import labels, pb

STATUS = {value: label.upper() for value, label in labels.STATUS.items()}
TIER = labels.TIER
NO_ANSWER = "no answer from the edge agent in time"


@dataclass
class DriveResult:
    """What a drive sent and got back, updated as answers arrive."""

    sent: int = 0  # handed to the intake so far
    by_status: Counter[str] = field(default_factory=Counter)
    by_route: Counter[str] = field(default_factory=Counter)
    not_ok: Counter[tuple[str, str]] = field(default_factory=Counter)  # (status, error_message)
    latencies_ms: list[float] = field(default_factory=list)
    lost: int = 0
    elapsed_s: float = 0.0

    @property
    def answered(self) -> int:
        return len(self.latencies_ms)

    def as_dict(self) -> dict[str, Any]:
        lat = np.array(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        p50, p90, p99 = (round(float(x), 2) for x in np.percentile(lat, [50, 90, 99]))
        return {
            "sent": self.sent,
            "answered": dict(self.by_status),
            "by_tier_pool": dict(self.by_route),
            "not_ok": [
                {"status": status, "error_message": message, "count": count}
                for (status, message), count in self.not_ok.most_common()
            ],
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
        lines.extend(
            f"not OK: {count} {status}: {message or '(no message)'}"
            for (status, message), count in self.not_ok.most_common()
        )
        return "\n".join(lines)


def synthetic_requests(region: str, n: int, rate: float, seed: int = 8) -> list[SyntheticRequest]:
    """``n`` requests of ``region``'s synthetic traffic arriving at ``rate`` per second."""
    return SyntheticTraffic(seed, regions=(region,), rate_per_s=rate).take(n)


async def drive_requests(
    intake: str,
    generated: Sequence[SyntheticRequest],
    result: DriveResult | None = None,
    *,
    start: float | None = None,
) -> DriveResult:
    """Send ``generated`` to ``intake`` at their arrival offsets from ``start`` (a ``perf_counter``
    time; now when None), one ``EdgeClient.infer`` each, and collect the answers into ``result``."""
    result = result if result is not None else DriveResult()
    start = time.perf_counter() if start is None else start
    async with EdgeClient(intake, service="synthetic") as client:

        async def one(g: SyntheticRequest) -> None:
            request = pb.InferRequest()
            request.CopyFrom(g.request)
            request.request_id = b""
            sent = time.perf_counter()
            response = await client.infer(request, deadline_s=g.budget_ms / 1000)
            result.latencies_ms.append((time.perf_counter() - sent) * 1000)
            status = STATUS.get(response.status, str(response.status))
            result.by_status[status] += 1
            if response.status == pb.STATUS_OK:
                result.by_route[f"{TIER.get(response.tier, '?')}/{response.pool or '-'}"] += 1
            else:
                result.not_ok[(status, response.error_message)] += 1
                if response.error_message == NO_ANSWER:
                    result.lost += 1

        tasks = []
        for g in generated:
            delay = start + g.offset_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(g)))
            result.sent += 1
        await asyncio.gather(*tasks)
    result.elapsed_s = time.perf_counter() - start
    return result


async def drive(intake: str, region: str, n: int, rate: float, seed: int = 8) -> DriveResult:
    """Generate ``n`` of ``region``'s synthetic requests and drive them through ``intake`` at ``rate``."""
    return await drive_requests(intake, synthetic_requests(region, n, rate, seed))
