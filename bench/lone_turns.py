"""Lone realtime requests only, two trees taking turns many times: p50, p99 and CPU per request of each run.

    python -m bench.lone_turns --old /tmp/old [--new .] [--rates 500,2000] [--repeats 8] [--seconds 3]

``bench.frame_path`` measures the lone path in three repeats beside everything else; on this shared
two-core machine one run's p99 at 2000/s swings between 5 and 25 ms for the same tree, so three say little
about a change to it. Here only the lone runs: each tree's gateway (null backend, bench/frame_path.py's
config and workload, one request per frame marked realtime, open loop, separate processes) and the raw
DEALER/ROUTER echo, ``--repeats`` rounds at each rate, the trees in turn (old first in even rounds),
each run's figures printed as it ends and the medians over the rounds at the end: latency from the
scheduled send (p50, p99), the gateway's process-tree CPU per request answered, answered and lost.
Loopback only; each run is bounded by its rate and ``--seconds``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench.frame_path import Tree, _pct, copies, lone_run, mixed_requests, start_tree
from bench.gateway_bench import Peer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="checkout of the code before")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--rates", default="500,2000", help="requests per second, comma-separated")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="one run")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    trees = [Tree("old", args.old.resolve()), Tree("new", args.new.resolve())]
    requests = copies(mixed_requests(seed=24))
    # per rate, per peer: (p50 ms, p99 ms, CPU us per request, answered, lost) of each run
    runs: dict[float, dict[str, list[tuple[float, float, float, int, int]]]] = {
        rate: {name: [] for name in ("old", "new", "echo")} for rate in rates
    }
    with tempfile.TemporaryDirectory() as tmp:
        peers = {tree.label: start_tree(tree, Path(tmp) / tree.label) for tree in trees}
        peers["echo"] = Peer("echo (raw DEALER/ROUTER)", [sys.executable, "-m", "bench.echo"], "stdout")
        try:
            others = {k: [p for n, p in peers.items() if n != k] for k in peers}
            for tree in trees:  # warm-up: caches, the CPU stage
                lone_run(peers[tree.label], others[tree.label], requests, rates[0], 0.5)
            for repeat in range(args.repeats):
                order = ["old", "new"] if repeat % 2 == 0 else ["new", "old"]
                for rate in rates:
                    for name in [*order, "echo"]:
                        run = lone_run(peers[name], others[name], requests, rate, args.seconds)
                        latencies = sorted(run.latencies_ms)
                        figures = (
                            _pct(latencies, 50),
                            _pct(latencies, 99),
                            run.cpu.tree / max(1, run.answered) * 1e6,
                            run.answered,
                            run.lost,
                        )
                        runs[rate][name].append(figures)
                        print(
                            f"round {repeat + 1} at {rate:g}/s {name}: p50 {figures[0]:.3f} ms, p99 "
                            f"{figures[1]:.2f} ms, {figures[2]:.0f} us CPU per request, "
                            f"{run.answered} answered, {run.lost} lost",
                            flush=True,
                        )
        finally:
            for peer in peers.values():
                peer.close()
    print(f"\nold = {trees[0].root}, new = {trees[1].root}; medians over {args.repeats} rounds")
    print("| rate | peer | p50 ms | p99 ms | CPU us per request | p99 of each round, ms | answered / lost |")
    print("|---|---|---|---|---|---|---|")
    for rate, by_peer in runs.items():
        for name, done in by_peer.items():
            p50, p99, cpu = (statistics.median(r[i] for r in done) for i in range(3))
            print(
                f"| {rate:g}/s | {name} | {p50:.3f} | {p99:.2f} | {cpu:.0f} | "
                f"{', '.join(f'{r[1]:.1f}' for r in done)} | "
                f"{sum(r[3] for r in done):,} / {sum(r[4] for r in done)} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
