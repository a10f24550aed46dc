"""Issue 24's gauge: the gateway's hot path before and after a change, both measured in one run.

    python -m bench.frame_path [--old /tmp/old] [--new .] [--seconds 5] [--repeats 3] [--write] [--json FILE]

Two gateways run side by side with the null backend: one on the code of ``--old`` (a checkout of the code
before the change, e.g. ``git worktree add /tmp/old HEAD``), started with its cwd and PYTHONPATH set to
that directory, and one on ``--new`` (this checkout by default). A one-off check imports the packages the
same way and asserts that each comes from its tree. Every figure is measured for both, the two taking
turns in each repeat (old first in even repeats, new first in odd ones), against baselines of the same run:

1. **Batched**: frames of 100 mixed requests (60 ranking requests of 8-32 candidates, 40 short text
   queries, shuffled, a fixed seed), encoded before each run (bench/ingest_bench.py's ``prebuild`` and
   ``ingest``; the frames come from 8 agent ids in turn), 8 frames in flight, the config
   bench/gateway_bench.py's ``start_gateway`` writes. Records/s,
   and the gateway's CPU per record answered: its whole process tree (gateway, forkserver, CPU-stage
   workers) from /proc, split into the main process (and, in it, the event loop thread and ZeroMQ's I/O
   threads, from /proc/PID/task) and its child processes.
2. **Minimal ingest**: bench/minimal_ingest.py with the same frames and driver, once per repeat.
3. **Lone realtime requests**: one realtime request per frame, open loop at 500/s and 2000/s
   (bench/gateway_bench.py's ``open_loop_drive``; latency from each request's scheduled send time), the
   same against the raw DEALER/ROUTER echo (bench/echo.py); gateway CPU per request and the overhead over
   the echo at p50 and p99 (latencies pooled over the repeats).
4. **grpcio**: one bidirectional stream, one message per request (bench/baselines.py), the same requests.
5. **Tensors**: ResNet-50 inputs, ``pixels`` FP16 [1, 3, 224, 224] (301,056 bytes raw), product photos
   decoded and normalised as a client would, in frames of 4, 8 frames in flight, to the ``resnet50`` spec of
   bench/gpu_tier.py's null repository (generic tensor pipeline) in a pool of its own: MB/s and MB per CPU
   second of the gateway's process tree.

Everything runs on loopback (re-run inside ``unshare --net`` as root), every loop is bounded in count and
time, and ``--write`` puts the table into docs/BENCHMARKS.md (section ``frame-path``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import numpy as np
import zmq
from PIL import Image

from bench import baselines
from bench.gateway_bench import (
    FEATURES,
    TICKS,
    Peer,
    Tracker,
    cpu_seconds,
    drain,
    pool_toml,
    restamp,
    start_gateway,
)
from bench.ingest_bench import ingest, open_loop, prebuild
from bench.netns import REPO, reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edge_agent.synthetic import SyntheticTraffic
from edge_agent.synthetic.images import product_photo
from edgewire import FrameCodec, pb
from inference.models.demo import write_demo_repository
from inference.pipeline.tensor import tensor_from_array

PACKAGES: Final = ("gateway", "edgewire", "inference", "routing", "service")
"""The packages a gateway process runs: each must come from the tree under test."""
FRAME: Final = 100
RANKING_PER_FRAME: Final = 60  # the rest of each frame are short text queries
CANDIDATES: Final = (8, 32)
AGENTS: Final = 8  # agent ids the frames come from, round robin
TEMPLATE_FRAMES: Final = 40  # distinct frames of requests, cycled with fresh ids
MAX_FRAMES: Final = 4000  # one batched run's frames at most (~140 MB encoded, ~4 s to build)
MIN_FRAMES: Final = 30
RATES: Final = (500.0, 2000.0)
LONE_SECONDS: Final = 3.0  # one open-loop run at most (each rate, each peer, each repeat)
TENSOR_MODEL: Final = "resnet50"
TENSOR_FRAME: Final = 4
TENSOR_TEMPLATES: Final = 16
TENSOR_SECONDS: Final = 3.0
TENSOR_MAX_FRAMES: Final = 800  # ~960 MB of frames at most, built before a run
IMAGENET_MEAN: Final = (0.485, 0.456, 0.406)
IMAGENET_STD: Final = (0.229, 0.224, 0.225)
TENSOR_POOL_TOML: Final = (
    pool_toml("gpu-tensor", "cloud", [TENSOR_MODEL], max_batch_size=32, preferred=(32,))
    + f"""
[routing.models.{TENSOR_MODEL}]
kind = "tensor"
"""
)
T = TypeVar("T")
GOAL_OWN_US: Final = 10.0
GOAL_ALL_US: Final = 20.0
GOAL_MINIMAL_RATIO: Final = 0.5
GOAL_LONE_US: Final = 60.0
GOAL_GRPC_RATIO: Final = 10.0
GOAL_P50_OVERHEAD_MS: Final = 0.150
GOAL_P99_OVERHEAD_MS: Final = 2.0


# ------------------------------------------------------------------ the code under test


@dataclass(frozen=True)
class Tree:
    """A checkout whose gateway is measured: a label for the table and its root."""

    label: str
    root: Path


def imported_from(root: Path) -> dict[str, str]:
    """Where each package comes from in a Python started as the gateway is (cwd and PYTHONPATH = root)."""
    code = f"import json, {', '.join(PACKAGES)}; print(json.dumps({{m.__name__: m.__file__ for m in "
    code += f"({', '.join(PACKAGES)},)}}))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    files: dict[str, str] = json.loads(out)
    strays = {m: f for m, f in files.items() if not Path(f).resolve().is_relative_to(root.resolve())}
    if strays:
        raise RuntimeError(f"not the code of {root}: {strays}")
    return files


def code_digest(root: Path) -> str:
    """A digest of the Python sources of the gateway's packages in ``root`` (equal digests: same code)."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def check_running(peer: Peer, root: Path) -> None:
    """The started gateway's cwd and PYTHONPATH are ``root`` (read from /proc)."""
    pid = peer.proc.pid
    cwd = Path(f"/proc/{pid}/cwd").resolve()
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
    )
    if cwd != root.resolve() or environ.get("PYTHONPATH") != str(root):
        raise RuntimeError(f"{peer.name} runs in {cwd} with PYTHONPATH {environ.get('PYTHONPATH')!r}")


# ------------------------------------------------------------------ workloads


def mixed_requests(seed: int, frames: int = TEMPLATE_FRAMES) -> list[pb.InferRequest]:
    """``frames`` x 100 requests, each 100 exactly 60 ranking requests (8-32 candidates, trimmed from the
    synthetic traffic's) and 40 short text queries (its search queries, not its catalog descriptions),
    shuffled within the frame; the same for the same seed."""
    rng = np.random.default_rng([seed, 24])
    traffic = SyntheticTraffic(seed, kind_mix=((pb.REQUEST_KIND_RANKING, 0.6), (pb.REQUEST_KIND_TEXT, 0.4)))
    ranking: list[pb.InferRequest] = []
    text: list[pb.InferRequest] = []
    want_ranking, want_text = frames * RANKING_PER_FRAME, frames * (FRAME - RANKING_PER_FRAME)
    for _ in range(10 * frames * FRAME):
        if len(ranking) >= want_ranking and len(text) >= want_text:
            break
        request = traffic.next().request
        if request.kind == pb.REQUEST_KIND_RANKING and len(ranking) < want_ranking:
            r = request.ranking
            n = min(int(rng.integers(CANDIDATES[0], CANDIDATES[1] + 1)), len(r.candidate_item_ids))
            del r.candidate_item_ids[n:]
            del r.candidate_dense[n * r.candidate_feature_width :]
            r.top_k = min(r.top_k, n)
            ranking.append(request)
        elif (
            request.kind == pb.REQUEST_KIND_TEXT
            and len(text) < want_text
            and request.priority != pb.PRIORITY_CLASS_BATCH  # batch text jobs are long descriptions
        ):
            text.append(request)
    out: list[pb.InferRequest] = []
    per_text = FRAME - RANKING_PER_FRAME
    for f in range(frames):
        frame = (
            ranking[f * RANKING_PER_FRAME : (f + 1) * RANKING_PER_FRAME]
            + text[f * per_text : (f + 1) * per_text]
        )
        out.extend(frame[i] for i in rng.permutation(len(frame)))
    if len(out) != frames * FRAME:
        raise RuntimeError(f"the synthetic traffic gave {len(ranking)} ranking, {len(text)} text requests")
    return out


def copies(requests: Sequence[pb.InferRequest]) -> list[pb.InferRequest]:
    """Independent copies (the open-loop driver rewrites each request's priority, id and deadline)."""
    out = []
    for request in requests:
        copy = pb.InferRequest()
        copy.CopyFrom(request)
        out.append(copy)
    return out


def tensor_requests(seed: int, n: int = TENSOR_TEMPLATES) -> list[pb.InferRequest]:
    """``n`` ResNet-50 inputs: 224 x 224 product photos (JPEG) decoded, scaled, normalised with the ImageNet
    mean and std, channels first, FP16, with a batch dim of 1 (301,056 bytes of ``raw_data`` each)."""
    rng = np.random.default_rng([seed, 50])
    mean = np.array(IMAGENET_MEAN, np.float32)
    std = np.array(IMAGENET_STD, np.float32)
    out = []
    for _ in range(n):
        jpeg = product_photo(rng, 224, 224)
        rgb = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), np.float32) / 255.0
        pixels = ((rgb - mean) / std).transpose(2, 0, 1)[np.newaxis].astype(np.float16)
        request = pb.InferRequest(
            model_name=TENSOR_MODEL, kind=pb.REQUEST_KIND_TENSOR, priority=pb.PRIORITY_CLASS_INTERACTIVE
        )
        request.inputs.append(tensor_from_array("pixels", pixels))
        out.append(request)
    return out


def tensor_bytes(request: pb.InferRequest) -> int:
    return sum(len(t.raw_data) for t in request.inputs)


# ------------------------------------------------------------------ CPU from /proc


@dataclass
class Cpu:
    """CPU seconds of a process tree: all of it, its root process (by thread) and the root's descendants."""

    tree: float = 0.0
    main: float = 0.0
    children: float = 0.0
    threads: dict[str, float] = field(default_factory=dict)

    def __sub__(self, before: Cpu) -> Cpu:
        return Cpu(
            self.tree - before.tree,
            self.main - before.main,
            self.children - before.children,
            {k: v - before.threads.get(k, 0.0) for k, v in self.threads.items()},
        )

    def __add__(self, other: Cpu) -> Cpu:
        names = self.threads.keys() | other.threads.keys()
        return Cpu(
            self.tree + other.tree,
            self.main + other.main,
            self.children + other.children,
            {k: self.threads.get(k, 0.0) + other.threads.get(k, 0.0) for k in names},
        )

    def thread_group(self, group: str) -> float:
        return sum(v for k, v in self.threads.items() if thread_group(k) == group)


def thread_group(name: str) -> str:
    """``event loop`` (the main thread), ``zeromq`` (libzmq's I/O and reaper threads) or ``other``."""
    if name == "event loop":
        return name
    return "zeromq" if name.startswith("ZMQbg") else "other"


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process by name (/proc/PID/task/*/stat); the main thread is
    ``event loop``, threads of the same name are summed."""
    out: dict[str, float] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = "event loop" if task.name == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return out


def cpu_now(peer: Peer) -> Cpu:
    total, by_role = cpu_seconds(peer.proc.pid)
    return Cpu(
        total,
        by_role.get("main process", 0.0),
        by_role.get("child processes", 0.0),
        thread_seconds(peer.proc.pid),
    )


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting on I/O), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


class Watch:
    """CPU of the measured peer over a run; of every other peer (idle meanwhile, or it would skew the run);
    and of everything else on the machine that is not this benchmark (its driver and its peers)."""

    def __init__(self, peer: Peer, idle: Sequence[Peer]) -> None:
        self.peer = peer
        self.idle = idle

    def __enter__(self) -> Watch:
        self._before = cpu_now(self.peer)
        self._idle_before = [cpu_seconds(p.proc.pid)[0] for p in self.idle]
        self._driver = time.process_time()
        self._machine = machine_busy()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        machine = machine_busy() - self._machine
        driver = time.process_time() - self._driver
        self.cpu = cpu_now(self.peer) - self._before
        idle = [cpu_seconds(p.proc.pid)[0] - b for p, b in zip(self.idle, self._idle_before, strict=True)]
        self.idle_cores = max(idle, default=0.0) / self.seconds
        self.foreign_cores = max(0.0, machine - driver - self.cpu.tree - sum(idle)) / self.seconds


# ------------------------------------------------------------------ runs


@dataclass
class Batched:
    """One closed-loop run over pre-encoded frames of 100."""

    records: int
    refused: int
    seconds: float
    cpu: Cpu
    idle_cores: float
    foreign_cores: float

    @property
    def rate(self) -> float:
        return self.records / self.seconds


@dataclass
class Lone:
    """One open-loop run of lone realtime requests at one rate."""

    rate: float
    answered: int
    lost: int
    refused: int
    latencies_ms: list[float]
    cpu: Cpu
    idle_cores: float
    foreign_cores: float
    gateway_ms: list[float] = field(default_factory=list)  # the answers' timing.total_us (none: the echo)
    queue_ms: list[float] = field(default_factory=list)  # of it, the answers' timing.queue_us (the pool's)


@dataclass
class Tensors(Batched):
    """One closed-loop run of TENSOR frames: a batched run, and how many bytes each record carried."""

    bytes_per_record: int = 0


@dataclass
class Results:
    """Everything one run measured, by tree label (and ``echo`` / ``minimal`` for the baselines)."""

    batched: dict[str, list[Batched]] = field(default_factory=dict)
    minimal: list[Batched] = field(default_factory=list)
    lone: dict[str, dict[float, list[Lone]]] = field(default_factory=dict)
    tensors: dict[str, list[Tensors]] = field(default_factory=dict)
    grpc_per_s: float = 0.0
    trees: dict[str, dict[str, str]] = field(default_factory=dict)
    answers: dict[str, dict[str, int]] = field(default_factory=dict)  # a check frame's, by run and tree
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def frames_for(rate: float, seconds: float, per_frame: int, most: int) -> int:
    """Frames enough for ``seconds`` at 1.3x ``rate`` requests/s, at most ``most`` (a faster run ends
    when they are used up: its rate is still its rate, over a shorter run)."""
    return max(MIN_FRAMES, min(most, math.ceil(rate * seconds * 1.3 / per_frame)))


def batched_run(
    peer: Peer, idle: Sequence[Peer], requests: list[pb.InferRequest], frames: int, seconds: float
) -> Batched:
    built = spread(prebuild(requests, frames))
    with Watch(peer, idle) as watch:
        run = ingest(peer, built, seconds)
    return Batched(
        run["answered"], run["refused"], run["seconds"], watch.cpu, watch.idle_cores, watch.foreign_cores
    )


def lone_run(
    peer: Peer,
    idle: Sequence[Peer],
    requests: list[pb.InferRequest],
    rate: float,
    seconds: float,
    priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_REALTIME,
) -> Lone:
    with Watch(peer, idle) as watch:
        run = open_loop(peer, requests, rate, seconds, priority)
    refused = int(rate * seconds) - run["answered"] - run["lost"]
    return Lone(
        rate,
        run["answered"],
        run["lost"],
        refused,
        run["latencies_ms"],
        watch.cpu,
        watch.idle_cores,
        watch.foreign_cores,
        run["gateway_ms"],
        run["queue_ms"],
    )


def tensor_frames(requests: list[pb.InferRequest], frames: int) -> list[list[bytes]]:
    """``frames`` frames of 4 tensor requests (fresh ids), encoded before a run and sent uncompressed: the
    path the issue asks to take at most one copy (a frame zstd shrinks adds its decompression)."""
    codec = FrameCodec()
    out = []
    for f in range(frames):
        chunk = [requests[(f * TENSOR_FRAME + i) % len(requests)] for i in range(TENSOR_FRAME)]
        restamp(chunk, 120.0)
        out.append(
            codec.encode(
                pb.RequestBatch(requests=chunk),
                agent_id="bench",
                region="us-west",
                compress=False,
                features=FEATURES,
            )
        )
    return spread(out)


def spread(frames: list[list[bytes]], agents: int = AGENTS) -> list[list[bytes]]:
    """The frames re-addressed round robin from ``agents`` agent ids (``bench-0``, ...), as a gateway's
    traffic comes from many agents: one agent's cost budget (issue 24 item 4) is not what this measures."""
    codec = FrameCodec()
    return [
        codec.reframe(pb.Envelope.FromString(frame[0]), frame[1], agent_id=f"bench-{i % agents}")
        for i, frame in enumerate(frames)
    ]


def tensor_run(
    peer: Peer, idle: Sequence[Peer], requests: list[pb.InferRequest], frames: int, seconds: float
) -> Tensors:
    built = tensor_frames(requests, frames)
    with Watch(peer, idle) as watch:
        run = ingest(peer, built, seconds)
    return Tensors(
        run["answered"],
        run["refused"],
        run["seconds"],
        watch.cpu,
        watch.idle_cores,
        watch.foreign_cores,
        bytes_per_record=tensor_bytes(requests[0]),
    )


class CheckTracker(Tracker):
    """A Tracker that also completes the requests of a frame refused whole (``Ack.frame_reject``)."""

    def __init__(self, codec: FrameCodec) -> None:
        super().__init__(codec, True)
        self.frame_rejects: Counter[str] = Counter()

    def received(self, frames: list[bytes], at: float) -> None:
        payload = self.codec.decode(frames).payload
        if isinstance(payload, pb.Ack) and payload.frame_reject:
            reason = f"frame refused {pb.RejectReason.Name(payload.frame_reject)}"
            for rid in [r for r, f in self.frame_of.items() if f == payload.acked_message_id]:
                self.frame_rejects[reason] += 1
                self._complete(rid)
            return
        super().received(frames, at)


def statuses(peer: Peer, frames: list[list[bytes]]) -> dict[str, int]:
    """How the gateway answers these frames, request by request: statuses and refusals by name (the
    timed runs count answers from the envelopes only). Bounded: 10 s for all of them."""
    codec = FrameCodec()
    tracker = CheckTracker(codec)
    for frame in frames:
        batch = codec.decode(frame).payload
        assert isinstance(batch, pb.RequestBatch)
        tracker.sent(frame, batch.requests, time.perf_counter())
        peer.sock.send_multipart(frame, copy=False)
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    deadline = time.perf_counter() + 10
    while tracker.in_flight and time.perf_counter() < deadline:
        if poller.poll(100):
            drain(peer, tracker)
    named: Counter[str] = Counter(
        {pb.Status.Name(cast(pb.Status.ValueType, k)): v for k, v in tracker.statuses.items()}
    )
    named.update({f"nack {k}": v for k, v in tracker.nacks.items()})
    named.update(tracker.frame_rejects)
    named["unanswered"] = len(tracker.sent_at)
    return {k: v for k, v in named.items() if v}


def settle(peer: Peer, quiet_s: float = 1.0, most_s: float = 15.0) -> None:
    """Read and drop what a failed run left coming, until ``quiet_s`` pass without a message (bounded),
    so that the next run counts only its own answers."""
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    deadline = time.perf_counter() + most_s
    while time.perf_counter() < deadline and poller.poll(int(quiet_s * 1000)):
        while peer.sock.poll(0):
            peer.sock.recv_multipart()


def turns(trees: Sequence[Tree], repeat: int) -> list[Tree]:
    """The trees in this repeat's order: old first in even repeats, new first in odd ones."""
    return list(trees) if repeat % 2 == 0 else list(reversed(trees))


def start_tree(
    tree: Tree,
    work: Path,
    extra_toml: str = "",
    backend_options: str = "",
    max_queue_depth: int = 4096,
    every_class: bool = False,
) -> Peer:
    work.mkdir(parents=True, exist_ok=True)
    try:
        peer = start_gateway(
            work,
            "null",
            tree=tree.root,
            extra_toml=extra_toml,
            backend_options=backend_options,
            max_queue_depth=max_queue_depth,
            every_class=every_class,
        )
    except RuntimeError as exc:
        raise RuntimeError(f"the {tree.label} tree's gateway ({tree.root}) did not start: {exc}") from exc
    peer.name = f"hk-gateway ({tree.label})"
    check_running(peer, tree.root)
    return peer


def log(message: str) -> None:
    print(f"[frame_path {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure(trees: Sequence[Tree], seconds: float, repeats: int) -> Results:
    """Every figure for both trees, the trees taking turns in each repeat."""
    started = time.perf_counter()
    results = Results()
    for tree in trees:
        results.trees[tree.label] = {
            "root": str(tree.root),
            "digest": code_digest(tree.root),
            **imported_from(tree.root),
        }
    requests = mixed_requests(seed=24)
    log(f"workload: {len(requests)} requests, mean {_mean_size(requests):.0f} bytes serialized")
    results.grpc_per_s = baselines.grpc_stream([r.SerializeToString() for r in requests], seconds)
    log(f"grpcio: {results.grpc_per_s:,.0f} messages/s")
    with tempfile.TemporaryDirectory() as tmp:
        batched_and_lone(results, trees, Path(tmp), requests, seconds, repeats)
        try:
            tensor_phase(results, trees, Path(tmp), seconds, repeats)
        except RuntimeError as exc:  # a gateway that does not start with the tensor pool: keep the rest
            results.failures.append(f"tensor phase: {exc}")
    results.seconds = time.perf_counter() - started
    return results


def attempt(results: Results, what: str, peer: Peer, run: Callable[[], T]) -> T | None:
    """``run()``, or None when it fails (a peer that stops answering): the failure is kept for the report,
    and what the peer still sends is dropped before the next run."""
    try:
        return run()
    except RuntimeError as exc:
        results.failures.append(f"{what}: {exc}")
        log(f"{what} failed: {exc}")
        settle(peer)
        return None


def batched_and_lone(
    results: Results,
    trees: Sequence[Tree],
    work: Path,
    requests: list[pb.InferRequest],
    seconds: float,
    repeats: int,
) -> None:
    """Both gateways, the minimal ingest and the echo side by side: batched runs, then lone realtime."""
    lone_requests = copies(requests)
    for tree in trees:
        results.batched[tree.label] = []
    for name in [t.label for t in trees] + ["echo"]:
        results.lone[name] = {rate: [] for rate in RATES}
    peers: dict[str, Peer] = {}
    try:
        for tree in trees:
            peers[tree.label] = start_tree(tree, work / tree.label)
        peers["minimal"] = Peer("minimal ingest", [sys.executable, "-m", "bench.minimal_ingest"], "stdout")
        peers["echo"] = Peer("echo (raw DEALER/ROUTER)", [sys.executable, "-m", "bench.echo"], "stdout")
        others = {k: [p for n, p in peers.items() if n != k] for k in peers}
        estimate: dict[str, float] = {}
        for name in [t.label for t in trees] + ["minimal"]:  # warm-up: workers, arena, caches; a rate
            peer = peers[name]
            warm = attempt(
                results, f"warm-up {name}", peer, partial(batched_run, peer, others[name], requests, 60, 2.0)
            )
            estimate[name] = warm.rate if warm is not None else 1000.0
            if name != "minimal":
                attempt(
                    results,
                    f"warm-up lone {name}",
                    peer,
                    partial(lone_run, peer, others[name], lone_requests, RATES[0], 0.5),
                )
                results.answers[f"batched {name}"] = statuses(peers[name], prebuild(requests, 2))
        log(f"warmed up: {', '.join(f'{k} {v:,.0f}/s' for k, v in estimate.items())}")
        for repeat in range(repeats):
            order = [t.label for t in turns(trees, repeat)]
            for name in [*order, "minimal"]:
                peer, frames = peers[name], frames_for(estimate[name], seconds, FRAME, MAX_FRAMES)
                run = attempt(
                    results,
                    f"repeat {repeat + 1} batched {name}",
                    peer,
                    partial(batched_run, peer, others[name], requests, frames, seconds),
                )
                if run is None:
                    continue
                estimate[name] = max(estimate[name], run.rate)
                (results.minimal if name == "minimal" else results.batched[name]).append(run)
                log(f"repeat {repeat + 1} batched {name}: {run.rate:,.0f} records/s ({frames} frames)")
            for rate in RATES:
                for name in [*order, "echo"]:
                    peer = peers[name]
                    lone = attempt(
                        results,
                        f"repeat {repeat + 1} lone realtime at {rate:g}/s {name}",
                        peer,
                        partial(
                            lone_run, peer, others[name], lone_requests, rate, min(seconds, LONE_SECONDS)
                        ),
                    )
                    if lone is not None:
                        results.lone[name][rate].append(lone)
                log(f"repeat {repeat + 1} lone realtime at {rate:g}/s done")
    finally:
        for peer in peers.values():
            peer.close()


def tensor_phase(results: Results, trees: Sequence[Tree], work: Path, seconds: float, repeats: int) -> None:
    """Both gateways again, with a pool for the tensor model: TENSOR frames, the trees taking turns."""
    # Imported here: bench.gpu_tier imports the whole gateway package (gateway.testing), which the driver
    # needs for nothing else.
    from bench.gpu_tier import null_repository, null_specs

    tensors = tensor_requests(seed=24)
    for tree in trees:
        results.tensors[tree.label] = []
    peers: dict[str, Peer] = {}
    try:
        for tree in trees:
            models = work / f"{tree.label}-tensor" / "models"
            write_demo_repository(models)
            null_repository(models, {TENSOR_MODEL: null_specs()[TENSOR_MODEL]})
            peers[tree.label] = start_tree(tree, models.parent, TENSOR_POOL_TOML)
        others = {k: [p for n, p in peers.items() if n != k] for k in peers}
        estimate: dict[str, float] = {}
        for name, peer in peers.items():
            warm = attempt(
                results,
                f"tensor warm-up {name}",
                peer,
                partial(tensor_run, peer, others[name], tensors, 40, 1.0),
            )
            estimate[name] = warm.rate if warm is not None else 100.0
            results.answers[f"tensors {name}"] = statuses(peer, tensor_frames(tensors, 2))
        run_seconds = min(seconds, TENSOR_SECONDS)
        for repeat in range(repeats):
            for tree in turns(trees, repeat):
                name, peer = tree.label, peers[tree.label]
                frames = frames_for(estimate[name], run_seconds, TENSOR_FRAME, TENSOR_MAX_FRAMES)
                run = attempt(
                    results,
                    f"repeat {repeat + 1} tensors {name}",
                    peer,
                    partial(tensor_run, peer, others[name], tensors, frames, run_seconds),
                )
                if run is None:
                    continue
                estimate[name] = max(estimate[name], run.rate)
                results.tensors[name].append(run)
                log(f"repeat {repeat + 1} tensors {name}: {run.rate:,.0f} requests/s ({frames} frames)")
    finally:
        for peer in peers.values():
            peer.close()


def _mean_size(requests: Sequence[pb.InferRequest]) -> float:
    return statistics.fmean(r.ByteSize() for r in requests)


# ------------------------------------------------------------------ the table


def _us(seconds: float, count: int) -> float:
    return seconds / count * 1e6 if count else float("nan")


def _foreign(runs: Sequence[Batched | Lone | Tensors]) -> float:
    return statistics.fmean(r.foreign_cores for r in runs) if runs else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _met(value: float, ok: Callable[[float], bool]) -> str:
    return "met" if ok(value) else "not met"


@dataclass
class Figures:
    """One tree's figures, pooled over its repeats."""

    rate: float
    rates: list[float]
    tree_us: float
    main_us: float
    loop_us: float
    zmq_us: float
    other_us: float
    children_us: float
    cores: float
    refused: int
    lone: dict[float, dict[str, float]]
    tensor_mb_s: float
    tensor_mb_per_cpu_s: float
    tensor_us: float
    tensor_cores: float
    foreign_cores: float


def figures(results: Results, label: str) -> Figures:
    runs = results.batched[label]
    cpu = sum((r.cpu for r in runs), Cpu())
    records = sum(r.records for r in runs)
    seconds = sum(r.seconds for r in runs)
    lone: dict[float, dict[str, float]] = {}
    for rate, lruns in results.lone[label].items():
        echo = [v for r in results.lone["echo"][rate] for v in r.latencies_ms]
        lat = [v for r in lruns for v in r.latencies_ms]
        gateway = [v for r in lruns for v in r.gateway_ms]
        answered = sum(r.answered for r in lruns)
        p50, p99 = _pct(lat, 50), _pct(lat, 99)
        e50, e99 = _pct(echo, 50), _pct(echo, 99)
        lone[rate] = {
            "cpu_us": _us(sum(r.cpu.tree for r in lruns), answered),
            "loop_us": _us(sum(r.cpu.thread_group("event loop") for r in lruns), answered),
            "p50_ms": p50,
            "p99_ms": p99,
            "echo_p50_ms": e50,
            "echo_p99_ms": e99,
            "over_p50_ms": p50 - e50,
            "over_p99_ms": p99 - e99,
            "gateway_p50_ms": _pct(gateway, 50),
            "gateway_p99_ms": _pct(gateway, 99),
            "answered": answered,
            "lost": sum(r.lost for r in lruns),
            "refused": sum(r.refused for r in lruns),
        }
    truns = results.tensors.get(label, [])
    tcpu = sum(r.cpu.tree for r in truns)
    trecords = sum(r.records for r in truns)
    tseconds = sum(r.seconds for r in truns)
    mb = trecords * truns[0].bytes_per_record / 1e6 if truns else float("nan")
    return Figures(
        rate=float(np.median([r.rate for r in runs])) if runs else float("nan"),
        rates=[r.rate for r in runs],
        tree_us=_us(cpu.tree, records),
        main_us=_us(cpu.main, records),
        loop_us=_us(cpu.thread_group("event loop"), records),
        zmq_us=_us(cpu.thread_group("zeromq"), records),
        other_us=_us(cpu.thread_group("other"), records),
        children_us=_us(cpu.children, records),
        cores=_ratio(cpu.tree, seconds),
        refused=sum(r.refused for r in runs),
        lone=lone,
        tensor_mb_s=_ratio(mb, tseconds),
        tensor_mb_per_cpu_s=_ratio(mb, tcpu),
        tensor_us=_us(tcpu, trecords),
        tensor_cores=_ratio(tcpu, tseconds),
        foreign_cores=_foreign([*runs, *truns, *(r for v in results.lone[label].values() for r in v)]),
    )


class Rows:
    """The table's rows: a figure, its value for each tree, the goal and whether each tree meets it."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def text(self, name: str, old: str, new: str = "", goal: str = "") -> None:
        self.rows.append([name, old, new, goal, ""])

    def value(
        self,
        name: str,
        fmt: str,
        old: float,
        new: float,
        goal: str = "",
        ok: Callable[[float], bool] | None = None,
    ) -> None:
        status = "" if ok is None else f"{_met(old, ok)} / {_met(new, ok)}"
        self.rows.append([name, format(old, fmt), format(new, fmt), goal, status])


def _runs(values: Sequence[float]) -> str:
    return " / ".join(f"{v / 1000:.1f}k" for v in values)


def _at_most(limit: float) -> Callable[[float], bool]:
    return lambda v: v <= limit


def _at_least(limit: float) -> Callable[[float], bool]:
    return lambda v: v >= limit


def table_rows(results: Results, trees: Sequence[Tree]) -> list[list[str]]:
    old, new = (figures(results, t.label) for t in trees)
    minimal = float(np.median([r.rate for r in results.minimal])) if results.minimal else float("nan")
    grpc = results.grpc_per_s
    t = Rows()
    t.text(
        "Batched: records/s (median; each run)",
        f"{old.rate:,.0f} ({_runs(old.rates)})",
        f"{new.rate:,.0f} ({_runs(new.rates)})",
    )
    t.value(
        "Batched: gateway CPU per record, all included (process tree), us",
        ".1f",
        old.tree_us,
        new.tree_us,
        f"<= {GOAL_ALL_US:g} us",
        _at_most(GOAL_ALL_US),
    )
    t.value(
        "- main process (its own work, ZeroMQ's I/O, any pipeline run on the loop), us",
        ".1f",
        old.main_us,
        new.main_us,
        f"<= {GOAL_OWN_US:g} us own work",
        _at_most(GOAL_OWN_US),
    )
    t.value("-- of it the event loop thread, us", ".1f", old.loop_us, new.loop_us)
    t.value("-- of it ZeroMQ's I/O threads, us", ".1f", old.zmq_us, new.zmq_us)
    t.value("-- of it other threads, us", ".1f", old.other_us, new.other_us)
    t.value("- child processes (CPU-stage workers, forkserver), us", ".1f", old.children_us, new.children_us)
    t.value("Batched: cores used by the gateway's process tree", ".2f", old.cores, new.cores)
    t.text(
        "Minimal Python ingest, records/s (same frames and driver; median)",
        f"{minimal:,.0f} ({_runs([r.rate for r in results.minimal])})",
    )
    t.value(
        "Gateway / minimal ingest",
        ".3f",
        _ratio(old.rate, minimal),
        _ratio(new.rate, minimal),
        f">= {GOAL_MINIMAL_RATIO:g}x",
        _at_least(GOAL_MINIMAL_RATIO),
    )
    t.text("grpcio, one message per request, records/s", f"{grpc:,.0f}")
    t.value(
        "Gateway / grpcio",
        ".2f",
        _ratio(old.rate, grpc),
        _ratio(new.rate, grpc),
        f">= {GOAL_GRPC_RATIO:g}x",
        _at_least(GOAL_GRPC_RATIO),
    )
    for rate in RATES:
        a, b = old.lone[rate], new.lone[rate]
        top = rate == max(RATES)
        t.value(
            f"Lone realtime at {rate:g}/s: gateway CPU per request (process tree), us",
            ".0f",
            a["cpu_us"],
            b["cpu_us"],
            f"<= {GOAL_LONE_US:g} us",
            _at_most(GOAL_LONE_US),
        )
        t.value("- of it the event loop thread, us", ".0f", a["loop_us"], b["loop_us"])
        t.text(
            f"- p50 / p99 ms (raw echo: {a['echo_p50_ms']:.3f} / {a['echo_p99_ms']:.3f})",
            f"{a['p50_ms']:.3f} / {a['p99_ms']:.2f}",
            f"{b['p50_ms']:.3f} / {b['p99_ms']:.2f}",
        )
        t.value(
            "- overhead over the echo at p50, us",
            ".0f",
            a["over_p50_ms"] * 1e3,
            b["over_p50_ms"] * 1e3,
            f"<= {GOAL_P50_OVERHEAD_MS * 1e3:g} us" if top else "",
            _at_most(GOAL_P50_OVERHEAD_MS * 1e3) if top else None,
        )
        t.value(
            "- overhead over the echo at p99, ms",
            ".2f",
            a["over_p99_ms"],
            b["over_p99_ms"],
            f"<= {GOAL_P99_OVERHEAD_MS:g} ms" if top else "",
            _at_most(GOAL_P99_OVERHEAD_MS) if top else None,
        )
        t.text(
            "- of it the gateway's part (the answers' timing.total_us), p50 / p99 ms",
            f"{a['gateway_p50_ms']:.3f} / {a['gateway_p99_ms']:.2f}",
            f"{b['gateway_p50_ms']:.3f} / {b['gateway_p99_ms']:.2f}",
        )
        t.text(
            "- answered / refused / lost",
            f"{a['answered']:,.0f} / {a['refused']:,.0f} / {a['lost']:,.0f}",
            f"{b['answered']:,.0f} / {b['refused']:,.0f} / {b['lost']:,.0f}",
        )
    t.value("TENSOR fp16 1x3x224x224 (301 KB), frames of 4: MB/s", ",.0f", old.tensor_mb_s, new.tensor_mb_s)
    t.value(
        "- MB per CPU second of the process tree (MB/s per gateway core)",
        ",.0f",
        old.tensor_mb_per_cpu_s,
        new.tensor_mb_per_cpu_s,
    )
    t.value("- gateway CPU per tensor request, us", ",.0f", old.tensor_us, new.tensor_us)
    t.value("- cores used by the process tree", ".2f", old.tensor_cores, new.tensor_cores)
    t.value(
        "Cores used by processes outside this benchmark during the tree's runs (mean)",
        ".2f",
        old.foreign_cores,
        new.foreign_cores,
    )
    return t.rows


def render(results: Results, trees: Sequence[Tree], args: argparse.Namespace) -> str:
    """The markdown section: command, machine, the trees, the table and what it leaves out."""
    old, new = (results.trees[t.label] for t in trees)
    measured: list[Batched | Lone | Tensors] = [
        *(r for v in results.batched.values() for r in v),
        *results.minimal,
        *(r for v in results.lone.values() for runs in v.values() for r in runs),
        *(r for v in results.tensors.values() for r in v),
    ]
    idle = max((r.idle_cores for r in measured), default=float("nan"))
    foreign = [r.foreign_cores for r in measured] or [float("nan")]
    refused = ", ".join(f"{t.label} {sum(r.refused for r in results.batched[t.label]):,}" for t in trees)
    tensor_refused = ", ".join(
        f"{t.label} {sum(r.refused for r in results.tensors[t.label]):,}" for t in trees
    )
    command = (
        f"python -m bench.frame_path --old {args.old} --seconds {args.seconds:g} --repeats {args.repeats}"
    )
    if args.new != REPO:
        command += f" --new {args.new}"
    same = " (the same code: this run checks the gauge only)" if old["digest"] == new["digest"] else ""
    labels = [t.label for t in trees]
    failed = "".join(f"\n**Failed** (left out of the figures): {f}" for f in results.failures)
    answers = "; ".join(
        f"{k}: {', '.join(f'{n} {c}' for n, c in v.items())}" for k, v in results.answers.items()
    )
    return f"""## Hot path per frame, old code against new (issue 24)

`{command} --write` ({stamp()}; {machine()}; the whole run {results.seconds / 60:.1f} min).
Old: `{old["root"]}`, code {old["digest"]}; new: `{new["root"]}`, code {new["digest"]}{same}. Each
gateway runs with its cwd and PYTHONPATH set to its tree (checked before the run: every package imports from
it), the null backend and bench/gateway_bench.py's config; driver, gateways and baselines share the cores.
Batched: frames of 100 (60 ranking requests of 8-32 candidates, 40 short text queries, shuffled), encoded
before each run, 8 frames in flight, {args.repeats} run(s) of up to {args.seconds:g} s per tree, the trees
taking turns; CPU from /proc over the gateway's process tree (gateway, forkserver, CPU workers) per record
answered, the main process by thread. Lone realtime: one request per frame, open loop, latencies pooled over
the repeats, overhead = gateway minus the raw DEALER/ROUTER echo at that percentile; the gateway's part is
what its answers say it took (from a request's receipt, decoded, to its reply), the rest of a latency is
ZeroMQ, the kernel, the reader's turn and waiting for a core. Tensors: ResNet-50
inputs (product photos, normalised, FP16) sent uncompressed through the generic tensor pipeline, a pool of
their own.

{table(["figure", *labels, "goal", " / ".join(labels)], table_rows(results, trees))}

Refused in the batched runs: {refused}; in the tensor runs: {tensor_refused}. Frames come from 8 agent ids
in turn (one agent's cost budget is not what this measures). The idle peers (the other gateway, the
baselines) used at most {idle:.2f} cores while one was measured; processes outside this benchmark used
{statistics.fmean(foreign):.2f} cores on average during the runs, {max(foreign):.2f} at most (/proc/stat).
The main-process row bounds the gateway's own work from above: it also holds ZeroMQ's I/O threads and any
pipeline the loop runs inline; the split per step and per pipeline kind is a profile's, not this gauge's.
Answers to two check frames per gateway after its warm-up (the timed runs count envelopes): {answers}.
{failed}"""


def summary(results: Results, trees: Sequence[Tree]) -> dict[str, Any]:
    """The figures and every run's raw numbers (latencies left out), for --json."""
    out: dict[str, Any] = {
        "seconds": results.seconds,
        "trees": results.trees,
        "grpc_per_s": results.grpc_per_s,
        "answers": results.answers,
    }
    out["figures"] = {t.label: asdict(figures(results, t.label)) for t in trees}
    out["minimal"] = [asdict(r) for r in results.minimal]
    out["batched"] = {k: [asdict(r) for r in v] for k, v in results.batched.items()}
    out["lone"] = {
        k: {
            str(rate): [
                {**asdict(r), "latencies_ms": len(r.latencies_ms), "gateway_ms": len(r.gateway_ms)}
                for r in runs
            ]
            for rate, runs in v.items()
        }
        for k, v in results.lone.items()
    }
    out["tensors"] = {k: [asdict(r) for r in v] for k, v in results.tensors.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/old"), help="checkout of the code before")
    parser.add_argument("--new", type=Path, default=REPO, help="checkout of the code after (this one)")
    parser.add_argument("--seconds", type=float, default=5.0, help="one batched run at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    parser.add_argument("--json", type=Path, help="also write every run's figures to this file")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.frame_path", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    args.old, args.new = args.old.resolve(), args.new.resolve()
    trees = (Tree("old", args.old), Tree("new", args.new))
    results = measure(trees, args.seconds, args.repeats)
    report = render(results, trees, args)
    print(report)
    if args.json:
        args.json.write_text(json.dumps(summary(results, trees), indent=2))
    if args.write:
        update_section("frame-path", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
