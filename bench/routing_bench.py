"""Decisions per second per core of the routing policy (goal: at least 100k/s).

Runs :meth:`routing.TierPolicy.decide` over a fixed, seeded mix of ranking, text and image requests of all
priorities against the demo config, with live signals that put some pools near saturation, one pool
unhealthy and some requests on tight deadlines, so every branch of the hot path is exercised.

    .venv/bin/python -m bench.routing_bench [--seconds 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import fields

from routing import (
    PoolSignals,
    Priority,
    RequestKind,
    RequestProfile,
    TierPolicy,
    default_routing_config,
)

_MODELS = {
    RequestKind.RANKING: "rank-mlp",
    RequestKind.TEXT: "text-encoder",
    RequestKind.IMAGE: "image-classifier",
}
_REGIONS = ("ap-southeast-1", "ap-northeast-1", "us-west", "us-east", "eu-central", "eu-west")


def make_profiles(count: int, seed: int = 7) -> list[RequestProfile]:
    """A seeded mix of request profiles spanning the whole score range."""
    rng = random.Random(seed)
    profiles: list[RequestProfile] = []
    for _ in range(count):
        kind = rng.choice(list(_MODELS))
        candidates = int(2 ** rng.uniform(3, 14)) if kind is RequestKind.RANKING else 0
        profile = RequestProfile(
            kind,
            _MODELS[kind],
            priority=rng.choice(list(Priority)),
            remaining_deadline_s=rng.choice([None, 0.005, 0.02, 0.05, 0.2, 1.0]),
            candidates=candidates,
            feature_width=rng.choice([16, 32, 64, 128]) if candidates else 0,
            text_chars=int(2 ** rng.uniform(4, 13)) if kind is RequestKind.TEXT else 0,
            pixels=int(2 ** rng.uniform(10, 23)) if kind is RequestKind.IMAGE else 0,
            client_hint=rng.choice([0.0, 0.0, 0.0, 0.5, 0.9]),
            region=rng.choice(_REGIONS),
        )
        profiles.append(profile)
    return profiles


def make_signals() -> dict[str, PoolSignals]:
    """Signals with a busy CPU pool, a saturated MIG pool, an unhealthy V100 pool and a healthy A100."""
    return {
        "cpu": PoolSignals(queue_depth=40, ewma_latency_s=0.004, healthy=True),
        "gpu-a100-mig": PoolSignals(queue_depth=32, ewma_latency_s=0.003, healthy=True),
        "gpu-a100": PoolSignals(queue_depth=20, ewma_latency_s=0.002, healthy=True),
        "gpu-v100": PoolSignals(queue_depth=0, ewma_latency_s=0.0, healthy=False),
    }


def _rate(seconds: float, batch: int, body: Callable[[], None]) -> tuple[int, float]:
    """Run ``body`` (which makes ``batch`` decisions) for about ``seconds``; return decisions and time."""
    decisions = 0
    start = time.perf_counter()
    stop = start + seconds
    while time.perf_counter() < stop:
        body()
        decisions += batch
    return decisions, time.perf_counter() - start


def run(seconds: float, count: int = 4096) -> dict[str, object]:
    """Decide over the profile mix for about ``seconds`` (and as long again building each profile first)."""
    policy = TierPolicy(default_routing_config())
    profiles = make_profiles(count)
    rows = [tuple(getattr(p, f.name) for f in fields(RequestProfile)) for p in profiles]
    signals = make_signals()
    decide = policy.decide
    reasons = Counter(decide(p, signals).reason.value for p in profiles)  # also warms the plan cache

    def decide_only() -> None:
        for profile in profiles:
            decide(profile, signals)

    def build_and_decide() -> None:
        for row in rows:
            decide(RequestProfile(*row), signals)

    decisions, elapsed = _rate(seconds, len(profiles), decide_only)
    built, built_elapsed = _rate(seconds, len(rows), build_and_decide)
    return {
        "benchmark": "routing.decide",
        "decisions": decisions,
        "seconds": round(elapsed, 3),
        "decisions_per_s": round(decisions / elapsed),
        "with_profile_build_per_s": round(built / built_elapsed),
        "reason_mix": dict(sorted(reasons.items())),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figure (or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=2.0, help="how long to run (default 2)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    result = run(args.seconds)
    if args.write:
        from bench.report import machine, stamp, update_section

        update_section(
            "routing",
            "\n".join(
                [
                    "## Routing decisions (issue 3)",
                    "",
                    f"Command: `python -m bench.routing_bench --seconds {args.seconds:g} --write`  ",
                    f"Measured {stamp()} on {machine()}; one core, seeded request mix with tight deadlines,",
                    "a saturated and an unhealthy pool. Goal: >= 100k decisions/s per core.",
                    "",
                    f"- `TierPolicy.decide()`: **{result['decisions_per_s']:,} decisions/s**",
                    f"- profile build + `decide()`: {result['with_profile_build_per_s']:,} /s",
                    f"- reason mix: `{result['reason_mix']}`",
                ]
            ),
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(f"routing.decide: {result['decisions_per_s']:,} decisions/s on one core")
        print(f"profile build + decide: {result['with_profile_build_per_s']:,} /s on one core")
        print(f"reason mix: {result['reason_mix']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
