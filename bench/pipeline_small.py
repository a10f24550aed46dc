"""The CPU-stage pipelines' cost per request for small batches: ``prepare`` and ``finish`` of ranking and
text, as the gateway calls them (``worker.prepare_requests`` / ``worker.finish_batch``), for batches of 1,
4, 16 and 64 of issue 24's mix (ranking: 8-32 candidates; text: short queries, token cache warm).

    python -m bench.pipeline_small [--rounds 5] [--against DIR]

Each measurement runs in a fresh ``python -P`` with one tree's packages first on ``sys.path`` (this
checkout, or ``--against DIR``: another checkout, e.g. ``git worktree add /tmp/old HEAD``), alternating the
trees round by round on this shared machine; a round times every batch size (the CPU time of this thread,
``time.thread_time_ns``, over a few hundred requests) and the table shows the median of the rounds, in
microseconds per request. Outputs for ``finish`` are random arrays of the model's output shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

BATCH_SIZES = (1, 4, 16, 64)
KINDS = {"ranking": "rank-mlp", "text": "text-encoder"}
REQUESTS = 1_920  # per batch size and step in a round: 1,920 lone requests, 30 batches of 64
HERE = Path(__file__).resolve().parents[1]


def measure(tree: str) -> dict[str, float]:
    """One round in this process, with ``tree``'s packages: {"kind/step/batch": us per request}."""
    sys.path.insert(0, tree)
    import time

    import numpy as np

    from bench.frame_path import mixed_requests
    from inference.backends.modelrepo import spec_from_config
    from inference.models.demo import demo_config
    from inference.pipeline import worker

    requests = mixed_requests(5, 20)
    by_kind = {kind: [r for r in requests if r.model_name == model] for kind, model in KINDS.items()}
    rng = np.random.default_rng(7)
    result: dict[str, float] = {}
    for kind, model in KINDS.items():
        spec = spec_from_config(demo_config(model), "1", Path(model) / "config.pbtxt")
        pool = by_kind[kind]
        for size in BATCH_SIZES:
            count = REQUESTS // size
            batches = [[pool[(b * size + i) % len(pool)] for i in range(size)] for b in range(count)]
            for batch in batches[:4]:  # warm: tokenizer load, token cache, layout cache
                worker.prepare_requests(kind, spec, batch)
            start = time.thread_time_ns()
            prepared = [worker.prepare_requests(kind, spec, batch) for batch in batches]
            prepare_ns = time.thread_time_ns() - start
            outputs = []
            for p in prepared:
                rows = p.rows[-1].stop if kind == "ranking" else len(p.kept)
                outputs.append(
                    {o.name: rng.standard_normal((rows, *o.dims)).astype(np.float32) for o in spec.outputs}
                )
            start = time.thread_time_ns()
            for p, out in zip(prepared, outputs, strict=True):
                worker.finish_batch(kind, p, out)
            finish_ns = time.thread_time_ns() - start
            total = count * size
            result[f"{kind}/prepare/{size}"] = prepare_ns / total / 1e3
            result[f"{kind}/finish/{size}"] = finish_ns / total / 1e3
    return result


def _child(tree: Path) -> dict[str, float]:
    code = (
        "import json, runpy, sys; "
        f"m = runpy.run_path({str(Path(__file__).resolve())!r}); "
        f"print(json.dumps(m['measure']({str(tree)!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=tree, check=True, capture_output=True, text=True
    )
    values: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout, measured alternately")
    args = parser.parse_args(argv)
    trees: dict[str, Path] = {"this": HERE}
    if args.against is not None:
        trees = {"old": args.against.resolve(), "new": HERE}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(_child(tree))
    medians: dict[str, dict[str, Any]] = {
        name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for name, rounds in runs.items()
    }
    header = "step".ljust(18) + "".join(f"{f'{name} b={size}':>12}" for size in BATCH_SIZES for name in trees)
    print(f"us per request (CPU time, median of {args.rounds} rounds)")
    print(header)
    for kind in KINDS:
        for step in ("prepare", "finish"):
            line = f"{kind}/{step}".ljust(18)
            for size in BATCH_SIZES:
                for name in trees:
                    line += f"{medians[name][f'{kind}/{step}/{size}']:>12.1f}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
