"""Issue 24 item 3: 301 KB FP16 tensors from the ZeroMQ frame into the batch, old code vs new, one run.

    python -m bench.tensor_path [--old /tmp/old] [--new .] [--parsed-variant] [--tree LABEL=PATH ...]
                                [--frames 150] [--repeats 3] [--write] [--json FILE]

Two parts, each for the code before the change (``--old``, a checkout such as ``git worktree add /tmp/old
HEAD``) and after it (``--new``, this checkout), and the variants asked for (``--parsed-variant``: new
whose CPU stage hands the pipelines no payloads, so that item 3's share of new's figures shows; ``--tree``:
any other checkout), each run with its cwd and PYTHONPATH set to its tree (a
one-off check imports the packages that way and asserts that they come from that tree; the gateway's
cwd and PYTHONPATH are read back from /proc):

1. **Copies** (bench/tensor_probe.py, in process): frames of 1, 4 and 16 ResNet-50 inputs (FP16
   [1, 3, 224, 224], 301,056 bytes of raw_data each) received over ZeroMQ on loopback as the gateway
   receives them, prepared by the tree's ``CpuStage`` as its pool prepares a batch (the requests' bytes
   in the frame passed along where its ``prepare`` takes them): bytes allocated at the peak of the step per
   byte of raw_data (tracemalloc: Python objects and numpy arrays; 1.0 = one copy of the data), whether the
   batch's array is the frame's own memory, and the event loop's CPU per request of the step.
2. **Through the gateway** (null backend, bench/gateway_bench.py's ``start_gateway`` config plus two pools
   of the ``resnet50`` spec of bench/gpu_tier.py's null repository, generic tensor pipeline): 224 x 224
   product photos normalised as a client would (bench/frame_path.py's ``tensor_requests``), frames of 4
   from 32 agent ids in turn, 8 frames in flight, encoded before each run. Three runs per tree: frames
   sent uncompressed (CODEC_NONE: the payload is the received zmq.Frame) to a pool batching up to 32;
   the same to a pool of ``max_batch_size`` 1 (every batch one request: read in place, no copy at all);
   and frames as the codec chooses for these photos (zstd: the payload is the decompressed bytes). MB/s
   of raw_data answered and MB per CPU second of the gateway's process tree (bench.gateway_bench's
   ``cpu_seconds``), with the driver's own cores (it shares the machine).

The trees take turns (in order in even repeats, reversed in odd ones); the tables show each run's median
over the repeats, and each tree's MB per gateway CPU second against the first (old).
Every loop is bounded in count and time; run as root, it re-runs itself inside ``unshare --net``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from bench.frame_path import (
    PACKAGES,
    Tree,
    imported_from,
    settle,
    spread,
    start_tree,
    statuses,
    tensor_requests,
)
from bench.gateway_bench import pool_toml, restamp
from bench.gpu_tier import null_repository, null_specs
from bench.ingest_bench import ingest
from bench.netns import REPO, reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edgewire import FrameCodec, pb
from inference.models.demo import write_demo_repository

MODEL: Final = "resnet50"
SINGLES: Final = "resnet50-b1"  # the same spec in a pool that batches one request at a time
PER_FRAME: Final = 4
AGENTS: Final = 32  # agent ids the frames come from (each agent's cost budget is not what this measures)
CHECK_FRAMES: Final = 2  # frames whose every answer is checked before and after each timed run
RUN_SECONDS: Final = 20.0  # one timed run at most
PROBE_TIMEOUT_S: Final = 120
RAW_BYTES: Final = 3 * 224 * 224 * 2
POOLS_TOML: Final = (
    pool_toml("tensor", "cloud", [MODEL], max_batch_size=32, preferred=(32,))
    + pool_toml("tensor-b1", "cloud", [SINGLES], max_batch_size=1, preferred=(), max_queue_delay_us=0)
    + f"""
[routing.models.{MODEL}]
kind = "tensor"
[routing.models.{SINGLES}]
kind = "tensor"
"""
)


@dataclass(frozen=True)
class Mode:
    """One kind of timed run: which model (pool) the frames ask for and whether they are compressed."""

    label: str
    model: str
    compress: bool


MODES: Final = (
    Mode("uncompressed, batches of up to 32", MODEL, compress=False),
    Mode("uncompressed, batches of 1", SINGLES, compress=False),
    Mode("codec's choice (zstd), batches of up to 32", MODEL, compress=True),
)


@dataclass
class Run:
    """One timed run of one mode against one tree's gateway."""

    tree: str
    mode: str
    answered: int
    refused: int
    seconds: float
    gateway_cores: float
    driver_cores: float
    codec: str
    checked: dict[str, int]

    @property
    def mb_per_s(self) -> float:
        return self.answered * RAW_BYTES / self.seconds / 1e6

    @property
    def mb_per_cpu_s(self) -> float:
        return self.mb_per_s / self.gateway_cores if self.gateway_cores else 0.0


@dataclass
class Results:
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    gateways: dict[str, dict[str, str]] = field(default_factory=dict)  # /proc of each tree's gateway


PARSED_VARIANT: Final = "new-parsed"
_PASSES_PAYLOADS: Final = (
    "worker.prepare_requests(pipeline, spec, requests, payloads)",
    "self._in_thread(worker.prepare_requests, pipeline, spec, requests, payloads)",
)


def parsed_variant(new: Path, into: Path) -> Tree:
    """A copy of ``new``'s packages whose CPU stage does not hand the payloads to the pipelines it runs in
    the gateway (tensors read from the parsed requests, as before item 3): what is left is the share of
    the rest of the new code."""
    for package in PACKAGES:
        shutil.copytree(new / package, into / package, ignore=shutil.ignore_patterns("__pycache__"))
    cpu = into / "gateway" / "dispatch" / "cpu.py"
    source = cpu.read_text()
    for call in _PASSES_PAYLOADS:
        if source.count(call) != 1:
            raise RuntimeError(f"{cpu}: expected one {call!r}; the variant needs updating")
        source = source.replace(call, call.replace(", payloads)", ")"))
    cpu.write_text(source)
    return Tree(PARSED_VARIANT, into)


def log(message: str) -> None:
    print(f"[tensor_path {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def probe(tree: Tree) -> dict[str, Any]:
    """bench/tensor_probe.py run on ``tree``'s code; its files must come from that tree."""
    script = REPO / "bench" / "tensor_probe.py"
    out = subprocess.run(
        [sys.executable, "-P", str(script)],
        cwd=tree.root,
        env={**os.environ, "PYTHONPATH": str(tree.root)},
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the probe failed on {tree.root}: {out.stderr[-2000:]}")
    found: dict[str, Any] = json.loads(out.stdout)
    strays = {m: f for m, f in found["files"].items() if not Path(f).resolve().is_relative_to(tree.root)}
    if strays:
        raise RuntimeError(f"the probe of {tree.root} ran other code: {strays}")
    return found


def frames_for(mode: Mode, count: int, seed: int) -> list[list[bytes]]:
    """``count`` frames of ``PER_FRAME`` photos each (fresh ids), encoded as ``mode`` says."""
    requests = tensor_requests(seed)
    for request in requests:
        request.model_name = mode.model
    codec = FrameCodec()
    frames = []
    for f in range(count):
        chunk = [requests[(f * PER_FRAME + i) % len(requests)] for i in range(PER_FRAME)]
        restamp(chunk, 600.0)
        frames.append(
            codec.encode(
                pb.RequestBatch(requests=chunk), agent_id="bench", region="us-west", compress=mode.compress
            )
        )
    return spread(frames, AGENTS)


def codec_of(frames: Sequence[list[bytes]]) -> str:
    names = {pb.Codec.Name(pb.Envelope.FromString(f[0]).codec) for f in frames}
    return "/".join(sorted(n.removeprefix("CODEC_") for n in names))


def timed_run(peer: Any, tree: Tree, mode: Mode, frames: int, seed: int) -> Run:
    """Check a few frames' answers, run ``frames`` frames closed loop, check again."""
    before = statuses(peer, frames_for(mode, CHECK_FRAMES, seed + 1))
    built = frames_for(mode, frames, seed)
    driver_before = time.process_time()
    result = ingest(peer, built, RUN_SECONDS)
    driver = (time.process_time() - driver_before) / result["seconds"]
    settle(peer, quiet_s=0.3)
    after = statuses(peer, frames_for(mode, CHECK_FRAMES, seed + 2))
    checked = {k: before.get(k, 0) + after.get(k, 0) for k in {*before, *after}}
    return Run(
        tree.label,
        mode.label,
        result["answered"],
        result["refused"],
        result["seconds"],
        result["cores"],
        driver,
        codec_of(built),
        checked,
    )


def gateway_proc(peer: Any) -> dict[str, str]:
    """The gateway's cwd and PYTHONPATH, as /proc says (start_tree has checked them against its tree)."""
    pid = peer.proc.pid
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
    )
    return {"cwd": str(Path(f"/proc/{pid}/cwd").resolve()), "PYTHONPATH": environ.get("PYTHONPATH", "")}


def measure(trees: Sequence[Tree], frames: int, repeats: int) -> Results:
    results = Results()
    for tree in trees:
        imported_from(tree.root)
        log(f"probe: {tree.label} ({tree.root})")
        results.probes[tree.label] = probe(tree)
    with tempfile.TemporaryDirectory(prefix="tensor-path-") as tmp:
        work = Path(tmp)
        spec = null_specs()[MODEL]
        for tree in trees:  # start_gateway serves <workdir>/models
            models = work / tree.label / "models"
            write_demo_repository(models)
            null_repository(models, {MODEL: spec, SINGLES: dataclasses.replace(spec, name=SINGLES)})
        for repeat in range(repeats):
            for tree in trees if repeat % 2 == 0 else tuple(reversed(trees)):
                log(f"repeat {repeat + 1}/{repeats}: {tree.label} gateway")
                peer = start_tree(tree, work / tree.label, extra_toml=POOLS_TOML)
                try:
                    results.gateways[tree.label] = gateway_proc(peer)
                    for number, mode in enumerate(MODES):
                        run = timed_run(peer, tree, mode, frames, seed=100 * repeat + 10 * number)
                        log(f"  {mode.label}: {run.mb_per_s:,.0f} MB/s, {run.mb_per_cpu_s:,.0f} MB/CPU s")
                        results.runs.append(run)
                finally:
                    peer.close()
    return results


def render(results: Results, trees: Sequence[Tree], args: argparse.Namespace) -> str:
    probe_rows = []
    for tree in trees:
        found = results.probes[tree.label]
        for batch in found["batches"]:
            ratio = batch["peak_bytes"] / batch["raw_bytes"]
            us = batch["cpu_us_per_request"]
            probe_rows.append(
                [
                    tree.label,
                    str(batch["requests"]),
                    "yes" if found["takes_payloads"] else "no",
                    f"{ratio:.2f}",
                    f"{round(ratio)}",
                    "yes" if batch["shares_frame"] else "no",
                    "yes" if batch["writeable"] else "no (read-only)",
                    f"{us:.0f}",
                    f"{RAW_BYTES / us:,.0f}",
                ]
            )
    run_rows = []
    for mode in MODES:
        for tree in trees:
            runs = [r for r in results.runs if r.tree == tree.label and r.mode == mode.label]
            if not runs:
                continue
            checked = dict.fromkeys(runs[0].checked, 0)
            for r in runs:
                for k, v in r.checked.items():
                    checked[k] = checked.get(k, 0) + v
            run_rows.append(
                [
                    mode.label,
                    tree.label,
                    runs[0].codec,
                    f"{statistics.median(r.mb_per_s for r in runs):,.0f}",
                    f"{statistics.median(r.gateway_cores for r in runs):.2f}",
                    f"{statistics.median(r.mb_per_cpu_s for r in runs):,.0f} "
                    f"({min(r.mb_per_cpu_s for r in runs):,.0f}-{max(r.mb_per_cpu_s for r in runs):,.0f})",
                    f"{statistics.median(r.driver_cores for r in runs):.2f}",
                    f"{sum(r.answered for r in runs):,} / {sum(r.refused for r in runs)}",
                    ", ".join(f"{k.removeprefix('STATUS_')} {v}" for k, v in sorted(checked.items())),
                ]
            )
    ratios = []
    for mode in MODES:
        per = {
            t.label: statistics.median(
                r.mb_per_cpu_s for r in results.runs if r.tree == t.label and r.mode == mode.label
            )
            for t in trees
            if any(r.tree == t.label and r.mode == mode.label for r in results.runs)
        }
        base = per.get(trees[0].label)
        if base:
            against = ", ".join(f"{t.label} {per[t.label] / base:.2f}x" for t in trees[1:] if t.label in per)
            ratios.append(f"{mode.label}: {against}")
    where = ", ".join(
        f"{label} {g['cwd']} (PYTHONPATH {g['PYTHONPATH']})" for label, g in results.gateways.items()
    )
    variants = "".join(
        " --parsed-variant" if t.label == PARSED_VARIANT else f" --tree {t.label}={t.root}" for t in trees[2:]
    )
    command = f"python -m bench.tensor_path{variants} --frames {args.frames} --repeats {args.repeats} --write"
    load = os.getloadavg()[0]
    return "\n".join(
        [
            "## Wire tensors from the frame into the batch (issue 24 item 3)",
            "",
            f"Command: `{command}`  ",
            f"Measured {stamp()} on {machine()}; load average {load:.1f} at the end (the machine is",
            "shared: the driver, the gateway and whatever else runs on its two cores). Old = the code",
            f"before the change, new = this checkout; the gateways ran from {where}.",
            *(
                [
                    f"{PARSED_VARIANT} = new with its CPU stage handing no payloads to the pipelines it runs",
                    "in the gateway (tensors read from the parsed requests, as before): the rest of new's",
                    "share.",
                ]
                if any(t.label == PARSED_VARIANT for t in trees)
                else []
            ),
            "",
            "**Copies**, in process (bench/tensor_probe.py): a frame of N ResNet-50 inputs (FP16",
            "[1, 3, 224, 224], 301,056 bytes of raw_data each) received over ZeroMQ (`copy=False`) and",
            "prepared by the tree's `CpuStage` (the tensor pipeline, on the event loop). 'Peak / raw' =",
            "bytes allocated at the peak of the step per byte of raw_data (tracemalloc, Python objects and",
            "numpy arrays): 2 = raw_data copied out of the parsed request and then into the batch, 1 = one",
            "copy into the batch array, 0 = none (the batch is a read-only view of the frame).",
            "",
            table(
                [
                    "tree",
                    "requests per batch",
                    "payloads passed",
                    "peak / raw",
                    "copies",
                    "batch is the frame's memory",
                    "writeable",
                    "CPU us per request",
                    "MB per CPU s (the step)",
                ],
                probe_rows,
            ),
            "",
            f"**Through the gateway** (null backend): frames of {PER_FRAME} product photos (FP16, 301 KB",
            f"each), {args.frames} frames per run from {AGENTS} agent ids, 8 frames in flight; median of",
            f"{args.repeats} repeats (range: lowest-highest), the trees taking turns. MB/s = raw_data of the",
            "requests answered per wall second; 'MB per gateway CPU s' = the same per CPU second of the",
            "gateway's process tree (main process, forkserver, CPU workers). 'Checked' = statuses of the",
            "frames sent before and after each timed run, request by request.",
            "",
            table(
                [
                    "run",
                    "tree",
                    "codec",
                    "MB/s",
                    "gateway cores",
                    "MB per gateway CPU s (range)",
                    "driver cores",
                    "answered / refused",
                    "checked",
                ],
                run_rows,
            ),
            "",
            f"MB per gateway CPU second against {trees[0].label}: " + "; ".join(ratios) + ".",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/old"), help="checkout of the code before")
    parser.add_argument("--new", type=Path, default=REPO, help="checkout of the code after (this one)")
    parser.add_argument(
        "--tree", action="append", default=[], metavar="LABEL=PATH", help="another checkout to measure"
    )
    parser.add_argument(
        "--parsed-variant",
        action="store_true",
        help=f"also measure {PARSED_VARIANT}: new, its CPU stage passing no payloads to the pipelines",
    )
    parser.add_argument("--frames", type=int, default=150, help="frames per timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    parser.add_argument("--json", type=Path, help="also write every run's figures to this file")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.tensor_path", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    extra = [Tree(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.tree)]
    with tempfile.TemporaryDirectory(prefix="tensor-path-variant-") as variant:
        if args.parsed_variant:
            extra.append(parsed_variant(args.new.resolve(), Path(variant)))
        trees = (Tree("old", args.old.resolve()), Tree("new", args.new.resolve()), *extra)
        results = measure(trees, args.frames, args.repeats)
    report = render(results, trees, args)
    print(report)
    if args.json:
        runs = [
            {**dataclasses.asdict(r), "mb_per_s": r.mb_per_s, "mb_per_cpu_s": r.mb_per_cpu_s}
            for r in results.runs
        ]
        args.json.write_text(json.dumps({"probes": results.probes, "runs": runs}, indent=2))
    if args.write:
        update_section("tensor-path", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
