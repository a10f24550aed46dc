"""What decompressing a large zstd frame costs every other agent: how late the event loop runs while
bombs are decompressed, on the loop (as before) against on the inflate thread (gateway/ingress/inflate.py),
in the same run (issue 24 item 4).

    python -m bench.inflate_stall [--bombs 20] [--rate 5] [--declared-mib 32] [--repeat 3] [--write]

An in-process gateway (null backend, the bench pools, ``[budget]`` off so that every bomb is decompressed)
receives ``--bombs`` frames of ~1 KB of zstd that honestly declare ``--declared-mib`` MiB of zeros, at
``--rate`` per second, from a DEALER in another process (bench/budget_attack.py's attacker); each is
refused ``payload_invalid`` once decompressed. A 1 ms timer on the loop records how late each of its turns
comes: a frame decompressed on the loop shows as one late turn as long as its decompression, since no
other frame is read, no batch cut and no answer sent meanwhile. The two settings
(``limits.inflate_off_loop_bytes`` 0 and its default) take turns, each with a fresh gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.budget_attack import attacker
from bench.gateway_bench import GATEWAY_TOML, pools_toml
from bench.report import machine, stamp, table, update_section
from gateway.config import LimitsConfig, load_config
from gateway.server import Gateway
from gateway.testing import wait_for

TICK_S = 0.001
STALL_S = 0.005  # a turn this late or later counts as a stall


@dataclass
class Phase:
    off_loop: bool
    bombs: int
    refused: int
    off_loop_count: int
    ticks: int
    late_p50_ms: float
    late_p999_ms: float
    late_max_ms: float
    stalls: int  # turns at least STALL_S late
    stalled_ms: float  # their lateness, summed
    loop_cpu_s: float
    seconds: float


async def _phase(workdir: Path, off_loop: bool, args: argparse.Namespace) -> Phase:
    models = workdir / "models"
    if not models.exists():
        from inference.models.demo import write_demo_repository

        write_demo_repository(models)
    threshold = LimitsConfig().inflate_off_loop_bytes if off_loop else 0
    toml = GATEWAY_TOML.format(backend="null", models=models, backend_options="", pools=pools_toml())
    toml += f"\n[budget]\nenabled = false\n[limits]\ninflate_off_loop_bytes = {threshold}\n"
    path = workdir / f"gateway-{off_loop}.toml"
    path.write_text(toml)
    gw = Gateway(load_config(path, environ={}))
    await gw.start()
    try:
        endpoint = next(iter(gw.carriers.values())).endpoint
        loop = asyncio.get_running_loop()
        late: list[float] = []
        running = True

        def tick(due: float) -> None:
            now = time.perf_counter()
            late.append(now - due)
            if running:
                loop.call_later(TICK_S, tick, now + TICK_S)

        def refused() -> float:
            labels = {"carrier": "hgc", "reason": "payload_invalid"}
            return gw.metrics.registry.get_sample_value("hkgw_frames_rejected_total", labels) or 0.0

        ctx = mp.get_context("spawn")
        stop, sent = ctx.Event(), ctx.Value("l", 0)
        declared = args.declared_mib << 20
        sender = ctx.Process(
            target=attacker, args=(endpoint, declared, args.rate, args.bombs, stop, sent), daemon=True
        )
        sender.start()
        await asyncio.sleep(0.5)  # the attacker's start-up (a spawned interpreter) before the clock runs
        loop.call_later(TICK_S, tick, time.perf_counter() + TICK_S)
        started, cpu = time.perf_counter(), time.thread_time()
        with contextlib.suppress(TimeoutError):  # bounded: what was refused by then is reported
            await wait_for(lambda: refused() >= args.bombs, args.bombs / args.rate + 30, 0.05, "bombs")
        running = False
        seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
        stop.set()
        sender.join(5)
        counted = gw.metrics.registry.get_sample_value(
            "hkgw_frames_inflated_off_loop_total", {"carrier": "hgc"}
        )
        late.sort()
        stalls = [x for x in late if x >= STALL_S]
        return Phase(
            off_loop=off_loop,
            bombs=int(sent.value),
            refused=int(refused()),
            off_loop_count=int(counted or 0),
            ticks=len(late),
            late_p50_ms=late[len(late) // 2] * 1e3,
            late_p999_ms=late[min(len(late) - 1, int(len(late) * 0.999))] * 1e3,
            late_max_ms=late[-1] * 1e3,
            stalls=len(stalls),
            stalled_ms=sum(stalls) * 1e3,
            loop_cpu_s=cpu,
            seconds=seconds,
        )
    finally:
        await gw.drain()
        await gw.aclose()


def render(phases: list[Phase], args: argparse.Namespace) -> str:
    rows = []
    for off_loop in (False, True):
        mine = [p for p in phases if p.off_loop == off_loop]

        def med(field: str, mine: list[Phase] = mine) -> float:
            return float(statistics.median(getattr(p, field) for p in mine))

        rows.append(
            [
                "inflate thread (default)" if off_loop else "event loop (`inflate_off_loop_bytes = 0`)",
                f"{med('bombs'):.0f} / {med('refused'):.0f} / {med('off_loop_count'):.0f}",
                f"{med('late_p50_ms'):.2f}",
                f"{med('late_p999_ms'):.2f}",
                f"{med('late_max_ms'):.1f} ({', '.join(f'{p.late_max_ms:.1f}' for p in mine)})",
                f"{med('stalls'):.0f}",
                f"{med('stalled_ms') / max(1.0, med('bombs')):.1f}",
                f"{med('loop_cpu_s') / med('seconds'):.3f}",
            ]
        )
    header = [
        "large frames decompressed on",
        "bombs sent / refused / off the loop",
        "loop turn late p50 ms",
        "p99.9 ms",
        "max ms (per repeat)",
        f"turns >= {STALL_S * 1e3:g} ms late",
        "lateness of those per bomb, ms",
        "event-loop CPU, s/s",
    ]
    return (
        "## Large frames decompressed off the event loop (issue 24 item 4)\n\n"
        f"Command: `python -m bench.inflate_stall --bombs {args.bombs} --rate {args.rate:g} "
        f"--declared-mib {args.declared_mib} --repeat {args.repeat} --write`  \n"
        f"Measured {stamp()} on {machine()}.\n\n"
        f"An in-process gateway (null backend, `[budget]` off so every bomb is decompressed) receives "
        f"{args.bombs} frames of ~1 KB of zstd declaring {args.declared_mib} MiB of zeros, {args.rate:g} a "
        "second, from another process; each is refused `payload_invalid` once decompressed. A 1 ms timer on "
        "the event loop records how late each turn comes. The two settings take turns, a fresh gateway "
        f"each; medians of {args.repeat} repeats. 'event-loop CPU': the loop thread's CPU seconds per second "
        "of the phase (the timer's own included); off the loop the decompression is the inflate thread's. "
        "What is left off the loop (a turn up to ~4 ms late per bomb) is freeing the 32 MiB buffer, which "
        "holds the GIL on whichever thread drops it last.\n\n" + table(header, rows)
    )


async def _main(args: argparse.Namespace) -> list[Phase]:
    phases = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for off_loop in (False, True):
                phase = await _phase(Path(tmp), off_loop, args)
                print(phase, file=sys.stderr)
                phases.append(phase)
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="loop lateness while bombs are decompressed, on vs off loop")
    parser.add_argument("--bombs", type=int, default=20)
    parser.add_argument("--rate", type=float, default=5.0)
    parser.add_argument("--declared-mib", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    phases = uvloop.run(_main(args))
    report = render(phases, args)
    print(report)
    if args.write:
        update_section("inflate_stall", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
