"""The CPU stage on its own: records/s per stage and request kind, core utilisation, padding waste.

1. **Per stage and kind** (one process, no IPC): ``prepare`` (requests -> tensors) and ``finish`` (model
   outputs -> wire responses) of the real pipelines over realistic synthetic batches of 32 (ranking counts
   candidate rows as records too), with the demo models' specs. Outputs for ``finish`` are random arrays of
   the model's output shape: no model runs here.
2. **Through the worker processes**, as the gateway runs them (``CpuStage``: forkserver workers fed from
   the event loop, requests and tensors through the shared-memory arena): prepare + finish of mixed
   batches from an event loop, a bounded number of batches in flight, with the utilisation of every core
   read from /proc/stat over the run, and how often the event loop itself got to run (a 1 ms ticker: its
   worst gap is what a health check or an ack would wait).
3. **Padding waste** of text: the synthetic text mix (short queries, long catalog descriptions) batched in
   arrival order vs grouped by the dispatcher's size bucket (``group_by_size``), tokens padded / real.

    .venv/bin/python -m bench.cpu_stage_bench [--seconds 2] [--write] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import machine, stamp, table, update_section
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.dispatch.cpu import CpuStage, default_workers
from gateway.ops.metrics import GatewayMetrics
from inference.backends.base import ModelSpec
from inference.backends.modelrepo import spec_from_config
from inference.models.demo import DEMO_MODELS, demo_config
from inference.pipeline import worker
from inference.pipeline.base import Pipeline, Prepared
from inference.pipeline.registry import pipeline_for
from inference.pipeline.text import length_bucket
from inference.pipeline.textsize import estimated_tokens

BATCH = 32
KINDS = {"rank-mlp": "ranking", "text-encoder": "text", "image-classifier": "image"}


def specs() -> dict[str, ModelSpec]:
    return {m: spec_from_config(demo_config(m), "1", Path(m) / "config.pbtxt") for m in DEMO_MODELS}


def requests_by_model(count: int, seed: int = 11) -> dict[str, list[pb.InferRequest]]:
    """``count`` synthetic requests per demo model, from the realistic mix."""
    found: dict[str, list[pb.InferRequest]] = defaultdict(list)
    for item in SyntheticTraffic(seed):
        request = item.request
        if len(found[request.model_name]) < count:
            found[request.model_name].append(request)
        if all(len(found[m]) >= count for m in DEMO_MODELS):
            return dict(found)
    raise AssertionError("unreachable: the traffic generator is endless")


def fake_outputs(spec: ModelSpec, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {o.name: rng.standard_normal((rows, *o.dims)).astype(np.float32) for o in spec.outputs}


def timed(fn: Callable[[], int], seconds: float) -> float:
    """Records per second of ``fn`` (which returns the records it handled), over about ``seconds``."""
    fn()  # warm: first-call imports, tokenizer load
    records, start = 0, time.perf_counter()
    deadline = start + seconds
    calls = 0
    while time.perf_counter() < deadline and calls < 100_000:
        records += fn()
        calls += 1
    return records / (time.perf_counter() - start)


def _prepare_once(pipeline: Pipeline, spec: ModelSpec, batches: Iterator[list[pb.InferRequest]]) -> int:
    return len(pipeline.prepare(next(batches), spec).kept)


def _finish_once(pipeline: Pipeline, work: Iterator[tuple[Prepared, dict[str, np.ndarray]]]) -> int:
    return len(pipeline.finish(*next(work)))


def per_stage(seconds: float) -> list[dict[str, Any]]:
    all_specs = specs()
    found = requests_by_model(BATCH * 8)
    rng = np.random.default_rng(1)
    results = []
    for model, kind in KINDS.items():
        spec, pipeline = all_specs[model], pipeline_for(kind)
        batches = [found[model][i : i + BATCH] for i in range(0, len(found[model]), BATCH)]
        prepared = [pipeline.prepare(b, spec) for b in batches]
        rows = [int(next(iter(p.inputs.values())).shape[0]) for p in prepared]
        outputs = [fake_outputs(spec, r, rng) for r in rows]
        work = itertools.cycle(list(zip(prepared, outputs, strict=True)))
        results.append(
            {
                "kind": kind,
                "model": model,
                "prepare_rps": timed(
                    partial(_prepare_once, pipeline, spec, itertools.cycle(batches)), seconds
                ),
                "finish_rps": timed(partial(_finish_once, pipeline, work), seconds),
                "rows_per_request": sum(rows) / sum(len(b) for b in batches),
            }
        )
    return results


def _cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies per core from /proc/stat."""
    cores = []
    with open("/proc/stat") as stat:
        for line in stat:
            if line.startswith("cpu") and line[3].isdigit():
                values = [int(v) for v in line.split()[1:]]
                idle = values[3] + values[4]
                cores.append((sum(values) - idle, sum(values)))
    return cores


async def through_pool(seconds: float, workers: int, inflight: int) -> dict[str, Any]:
    all_specs = specs()
    found = requests_by_model(BATCH * 4)
    rng = np.random.default_rng(2)
    jobs: list[tuple[str, ModelSpec, list[pb.InferRequest], dict[str, np.ndarray]]] = []
    for model, kind in KINDS.items():
        spec = all_specs[model]
        for i in range(0, len(found[model]), BATCH):
            requests = found[model][i : i + BATCH]
            rows = int(next(iter(worker.prepare_requests(kind, spec, requests).inputs.values())).shape[0])
            jobs.append((kind, spec, requests, fake_outputs(spec, rows, rng)))
    stage = CpuStage(
        workers, "process", GatewayMetrics(DEMO_MODELS), inline_max_requests=0, arena_slots=2 * inflight
    )
    stage.start()
    await stage.warm_up()
    done = {"requests": 0, "batches": 0}
    gaps: list[float] = []
    stop = time.monotonic() + seconds

    async def ticker() -> None:
        last = time.monotonic()
        while time.monotonic() < stop:
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def runner(offset: int) -> None:
        for kind, spec, requests, outputs in itertools.islice(itertools.cycle(jobs), offset, None):
            if time.monotonic() >= stop:
                return
            prepared = await stage.prepare(kind, spec, requests)
            stage.release(prepared)  # the backend call would be here
            kept = [requests[i] for i in prepared.kept]
            await stage.finish(kind, prepared, outputs, kept)
            done["requests"] += len(requests)
            done["batches"] += 1

    before, start = _cpu_times(), time.monotonic()
    await asyncio.gather(ticker(), *(runner(i) for i in range(inflight)))
    elapsed, after = time.monotonic() - start, _cpu_times()
    stage.close()
    utilisation = [(a[0] - b[0]) / max(a[1] - b[1], 1) for a, b in zip(after, before, strict=True)]
    return {
        "workers": workers,
        "inflight_batches": inflight,
        "requests_per_s": done["requests"] / elapsed,
        "batches": done["batches"],
        "core_utilisation": utilisation,
        "loop_gap_p99_ms": float(np.percentile(gaps, 99) * 1000) if gaps else 0.0,
        "loop_gap_max_ms": max(gaps) * 1000 if gaps else 0.0,
    }


def padding(count: int = 2048) -> dict[str, Any]:
    """Tokens padded / real for the text mix, in arrival order vs grouped by routing's size bucket."""
    spec = specs()["text-encoder"]
    texts = requests_by_model(count)["text-encoder"]
    pipeline = pipeline_for("text")
    buckets = [length_bucket(estimated_tokens(r.text.text)) for r in texts]  # what PoolDispatcher groups by

    def waste(batches: Sequence[Sequence[pb.InferRequest]]) -> tuple[float, int, int]:
        real = padded = 0
        for batch in batches:
            prepared = pipeline.prepare(batch, spec)
            real += prepared.real_elements
            padded += prepared.padded_elements
        return 1 - real / padded, real, padded

    arrival = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    groups: dict[int, list[pb.InferRequest]] = defaultdict(list)
    for request, bucket in zip(texts, buckets, strict=True):
        groups[bucket].append(request)
    grouped = [g[i : i + BATCH] for g in groups.values() for i in range(0, len(g), BATCH)]
    a, g = waste(arrival), waste(grouped)
    return {
        "requests": len(texts),
        "arrival": {"waste": a[0], "real": a[1], "padded": a[2], "batches": len(arrival)},
        "grouped": {"waste": g[0], "real": g[1], "padded": g[2], "batches": len(grouped)},
    }


def write(
    stages: list[dict[str, Any]], pools: list[dict[str, Any]], pad: dict[str, Any], seconds: float
) -> None:
    rows = [
        [r["kind"], f"{r['prepare_rps']:,.0f}", f"{r['finish_rps']:,.0f}", f"{r['rows_per_request']:.1f}"]
        for r in stages
    ]
    pool_rows = [
        [
            str(p["workers"]),
            f"{p['requests_per_s']:,.0f}",
            ", ".join(f"{u:.0%}" for u in p["core_utilisation"]),
            f"{p['loop_gap_p99_ms']:.1f} / {p['loop_gap_max_ms']:.1f}",
        ]
        for p in pools
    ]
    arrival, grouped = pad["arrival"], pad["grouped"]
    by_kind = {r["kind"]: r for r in stages}
    image_rps = by_kind["image"]["prepare_rps"]
    ranking_rows = by_kind["ranking"]["prepare_rps"] * by_kind["ranking"]["rows_per_request"]
    body = f"""## CPU stage (pre/post-processing)

`python -m bench.cpu_stage_bench --seconds {seconds:g} --write` ({stamp()}; {machine()}).

Per stage and kind, one process, batches of {BATCH} realistic synthetic requests (no model runs; `finish`
gets random outputs of the model's shape):

{table(["kind", "prepare req/s", "finish req/s", "model rows per request"], rows)}

Through the gateway's worker processes (`CpuStage`: forkserver workers fed from the loop, requests and
tensors through the shared-memory arena, {pools[0]["inflight_batches"]} batches in flight, mixed kinds,
prepare + finish), with each core's utilisation over the run and the gaps of a 1 ms ticker on the event
loop that feeds the pool (what a health check or an ack would wait). The gateway's default is every core
but one (`[cpu] workers = 0`):

{table(["workers", "req/s", "core utilisation", "loop gap p99 / max ms"], pool_rows)}

The mix cycles batch by batch over the three kinds, so image batches (JPEG decode and resize,
about {1000 / image_rps:.1f} ms per image on one core) take most of the time: the pool's rate is bounded by
the image stage, and more cores add to it. Ranking prepares {ranking_rows:,.0f} candidate rows/s per core.

Padding waste of text ({pad["requests"]} requests of the synthetic mix, batches of {BATCH}, length buckets
4..128): in arrival order **{arrival["waste"]:.0%}** of the tokens sent are padding ({arrival["padded"]:,}
sent for {arrival["real"]:,} real); grouped by estimated length bucket as the dispatcher does
(`group_by_size = true`, the default) **{grouped["waste"]:.0%}** ({grouped["padded"]:,} for
{grouped["real"]:,}, {grouped["batches"]} batches instead of {arrival["batches"]}).
"""
    update_section("cpu-stage", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--inflight", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stages = per_stage(args.seconds)
    cores = len(os.sched_getaffinity(0))
    pools = [
        asyncio.run(through_pool(args.seconds * 2, workers, args.inflight))
        for workers in sorted({default_workers(), cores})
    ]
    pad = padding()
    result = {"stages": stages, "pools": pools, "padding": pad, "cores": cores}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in stages:
            prepare, finish = r["prepare_rps"], r["finish_rps"]
            print(f"{r['kind']:8} prepare {prepare:>9,.0f} req/s  finish {finish:>9,.0f} req/s")
        for pool in pools:
            print(
                f"pool ({pool['workers']} workers): {pool['requests_per_s']:,.0f} req/s, cores "
                + ", ".join(f"{u:.0%}" for u in pool["core_utilisation"])
                + f", loop gap p99 {pool['loop_gap_p99_ms']:.1f} ms"
            )
        arrival, grouped = pad["arrival"]["waste"], pad["grouped"]["waste"]
        print(f"text padding waste: arrival {arrival:.0%}, grouped {grouped:.0%}")
    if args.write:
        write(stages, pools, pad, args.seconds)


if __name__ == "__main__":
    main()
