"""Gateway throughput and latency against a raw pyzmq DEALER/ROUTER echo, in one run.

    python -m bench.gateway_bench [--seconds 5] [--write]

Both peers run as separate processes on this machine; the same driver (this process) sends the same
serialized frames to each:

* throughput: RequestBatch frames of 100 realistic requests (ranking + text, the structured traffic),
  a window of 8 frames in flight; records/s = requests answered per second (gateway: response received;
  echo: frame echoed).
* latency: single-request realtime frames at a fixed offered rate, open loop (each latency is measured from
  the request's scheduled send time, so a stall is not hidden by coordinated omission).
* cores: CPU seconds the peer process used per wall second (> 1.0 means it used the second core), per thread.

The gateway runs with the null backend (its CPU pipelines, routing, batching and replies run as in
production, the model costs nothing) and, for the core count, with the embedded ONNX backend too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import zmq

from bench.report import machine, stamp, table, update_section
from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, new_id, now_unix_us, pb

TICKS = os.sysconf("SC_CLK_TCK")
FEATURES = pb.FEATURE_ACKS_IN_RESPONSES
"""What the bench's request frames say they read, as the reference agent's do: a gateway that knows the
feature sends a frame's Ack with the answers ready at the same time; one that does not ignores it."""


@dataclass
class Run:
    peer: str
    mode: str
    records: int
    seconds: float
    records_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    cores_used: float
    threads: dict[str, float]


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a process, from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS


def process_tree(root: int) -> list[int]:
    """A process and all its descendants (the gateway's forkserver and CPU workers), from /proc."""
    parents = {int(p.name): _stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, stat in parents.items():
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def cpu_seconds(root: int) -> tuple[float, dict[str, float]]:
    """CPU seconds of a process and all its descendants (the gateway's CPU-stage workers included)."""
    by_role: dict[str, float] = {}
    for pid in process_tree(root):
        stat = _stat(pid)
        if stat is not None:
            role = "main process" if pid == root else "child processes"
            by_role[role] = by_role.get(role, 0.0) + stat[1]
    return sum(by_role.values()), dict(by_role)


def workload(n: int, seed: int) -> list[pb.InferRequest]:
    out = []
    for r in SyntheticTraffic(seed).take(n * 2):
        if r.request.kind != pb.REQUEST_KIND_IMAGE:
            out.append(r.request)
        if len(out) == n:
            break
    return out


def restamp(requests: Sequence[pb.InferRequest], budget_s: float) -> None:
    deadline = now_unix_us() + int(budget_s * 1e6)
    for request in requests:
        request.request_id = new_id()
        request.deadline_unix_us = deadline


class Peer:
    """A peer process (the gateway or the echo) and a DEALER connected to it."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.http_port = 0
        self.endpoints: dict[str, str] = {}  # a gateway's: each carrier's
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self.endpoint = self._wait_endpoint(ready)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 100000)
        self.sock.setsockopt(zmq.RCVHWM, 100000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)

    def _wait_endpoint(self, ready: str) -> str:
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        stream = self.proc.stdout if ready == "stdout" else self.proc.stderr
        while time.monotonic() < deadline:
            line = stream.readline()
            if not line:
                raise RuntimeError(f"{self.name} exited: {self.proc.stderr.read()[-2000:]}")
            if ready == "stdout":
                return line.strip()
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "gateway ready":
                self.http_port = int(record["http_port"])
                self.endpoints = {str(name): str(at) for name, at in record["carriers"].items()}
                # Keep reading its logs, or a full pipe would block the peer's event loop.
                threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()
                return str(record["carriers"]["hgc"])
        raise RuntimeError(f"{self.name} not ready")

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Tracker:
    """Frames in flight and when each request was sent; completes a frame when all its requests are back."""

    def __init__(self, codec: FrameCodec, is_gateway: bool) -> None:
        self.codec = codec
        self.is_gateway = is_gateway
        self.frame_of: dict[bytes, bytes] = {}
        self.remaining: dict[bytes, int] = {}
        self.sent_at: dict[bytes, float] = {}
        self.latencies: list[float] = []
        self.done = 0
        self.statuses: Counter[int] = Counter()
        self.nacks: Counter[str] = Counter()

    def sent(self, frames: list[bytes], requests: Sequence[pb.InferRequest], at: float) -> None:
        frame_id = pb.Envelope.FromString(frames[0]).message_id
        self.remaining[frame_id] = len(requests)
        for request in requests:
            self.frame_of[request.request_id] = frame_id
            self.sent_at[request.request_id] = at

    def received(self, frames: list[bytes], at: float) -> None:
        if not self.is_gateway:  # the echo sends the frame back whole: every request of it is answered
            decoded = self.codec.decode(frames)
            assert isinstance(decoded.payload, pb.RequestBatch)
            ids = [r.request_id for r in decoded.payload.requests]
            self.statuses[pb.STATUS_OK] += len(ids)
        else:
            payload = self.codec.decode(frames).payload
            if isinstance(payload, pb.Ack):
                self._acked(payload)
                return
            if not isinstance(payload, pb.ResponseBatch):
                return
            for ack in payload.acks:  # Acks riding with answers (FEATURES below)
                self._acked(ack)
            ids = [r.request_id for r in payload.responses]
            self.statuses.update(r.status for r in payload.responses)
        for rid in ids:
            self.latencies.append(at - self.sent_at[rid])
            self._complete(rid)
        self.done += len(ids)

    def _acked(self, ack: pb.Ack) -> None:
        """Refused requests are done too, and counted apart."""
        if ack.frame_reject:  # the whole frame refused (e.g. over_budget): all of it
            refused = [r for r, f in self.frame_of.items() if f == ack.acked_message_id]
            self.nacks[pb.RejectReason.Name(ack.frame_reject)] += len(refused)
            for rid in refused:
                self._complete(rid)
            return
        self.nacks.update(pb.NackReason.Name(n.reason) for n in ack.nacks)
        for nack in ack.nacks:
            self._complete(nack.request_id)

    def _complete(self, rid: bytes) -> None:
        del self.sent_at[rid]
        frame_id = self.frame_of.pop(rid)
        self.remaining[frame_id] -= 1
        if not self.remaining[frame_id]:
            del self.remaining[frame_id]

    @property
    def in_flight(self) -> int:
        return len(self.remaining)


def drain(peer: Peer, tracker: Tracker) -> None:
    while True:
        try:
            got = peer.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        tracker.received(got, time.perf_counter())


def summarise(peer: Peer, mode: str, tracker: Tracker, elapsed: float, cpu_before: float) -> Run:
    used, threads = cpu_seconds(peer.proc.pid)
    lat = np.array(tracker.latencies) * 1000
    p50, p90, p99 = (float(x) for x in np.percentile(lat, [50, 90, 99]))
    if tracker.nacks:
        print(f"{peer.name} {mode}: refused {dict(tracker.nacks)}", file=sys.stderr)
    return Run(
        peer.name,
        mode,
        tracker.done,
        elapsed,
        tracker.done / elapsed,
        p50,
        p90,
        p99,
        (used - cpu_before) / elapsed,
        threads,
    )


class HealthProbe:
    """Polls a carrier health URL every 50 ms on a thread and keeps each answer's latency (GeoDNS view)."""

    def __init__(self, url: str) -> None:
        import threading

        self.url = url
        self.latencies_ms: list[float] = []
        self.statuses: Counter[int] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.error
        import urllib.request

        while not self._stop.wait(0.05):
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=2) as resp:
                    self.statuses[resp.status] += 1
            except urllib.error.HTTPError as err:
                self.statuses[err.code] += 1
            except OSError:
                self.statuses[0] += 1
            self.latencies_ms.append((time.perf_counter() - start) * 1000)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join()
        lat = np.array(self.latencies_ms)
        p50, p99 = np.percentile(lat, [50, 99])
        return (
            f"{len(lat)} probes, p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {lat.max():.1f} ms, "
            f"statuses {dict(self.statuses)}"
        )


def throughput(
    peer: Peer,
    requests: list[pb.InferRequest],
    seconds: float,
    is_gateway: bool,
    batch: int = 100,
    window: int = 8,
) -> Run:
    """Closed loop: ``window`` frames of ``batch`` requests in flight for ``seconds``."""
    codec = FrameCodec()
    tracker = Tracker(codec, is_gateway)
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    cpu_before, _ = cpu_seconds(peer.proc.pid)
    start = time.perf_counter()
    end = start + seconds
    offset = 0
    while time.perf_counter() < end or tracker.in_flight:
        while tracker.in_flight < window and time.perf_counter() < end:
            chunk = [requests[(offset + i) % len(requests)] for i in range(batch)]
            offset += batch
            restamp(chunk, 30.0)
            frames = codec.encode(
                pb.RequestBatch(requests=chunk), agent_id="bench", region="us-west", features=FEATURES
            )
            tracker.sent(frames, chunk, time.perf_counter())
            peer.sock.send_multipart(frames, copy=False)
        if not poller.poll(10_000):
            raise RuntimeError(f"{peer.name}: nothing back for 10 s ({tracker.in_flight} frames in flight)")
        drain(peer, tracker)
    return summarise(peer, f"throughput b{batch}", tracker, time.perf_counter() - start, cpu_before)


def latency(
    peer: Peer, requests: list[pb.InferRequest], rate: float, seconds: float, is_gateway: bool
) -> Run:
    """Open loop: one realtime request per frame at ``rate``/s; latency from the scheduled send time."""
    tracker = Tracker(FrameCodec(), is_gateway)
    cpu_before, _ = cpu_seconds(peer.proc.pid)
    elapsed = open_loop_drive(peer, requests, rate, seconds, tracker)
    return summarise(peer, f"latency {rate:g}/s", tracker, elapsed, cpu_before)


def open_loop_drive(
    peer: Peer,
    requests: list[pb.InferRequest],
    rate: float,
    seconds: float,
    tracker: Tracker,
    *,
    agent_id: str = "bench",
    budget_s: float = 5.0,
    wait_s: float = 10.0,
    priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_REALTIME,
) -> float:
    """Send one request per frame (``priority``: its class and its frame's, realtime unless said) at
    ``rate``/s for ``seconds`` as ``agent_id``, each stamped with its scheduled send time (no coordinated
    omission) and a deadline ``budget_s`` on; wait up to ``wait_s`` for the answers; the seconds it all
    took."""
    codec = tracker.codec
    poller = zmq.Poller()
    poller.register(peer.sock, zmq.POLLIN)
    total = int(rate * seconds)
    start = time.perf_counter()
    for i in range(total):
        scheduled = start + i / rate
        while (now := time.perf_counter()) < scheduled:
            if poller.poll(max(0, int((scheduled - now) * 1000))):
                drain(peer, tracker)
        request = requests[i % len(requests)]
        request.priority = priority
        restamp([request], budget_s)
        frames = codec.encode(
            pb.RequestBatch(requests=[request]),
            agent_id=agent_id,
            region="us-west",
            priority=priority,
            features=FEATURES,
        )
        tracker.sent(frames, [request], scheduled)
        peer.sock.send_multipart(frames, copy=False)
    deadline = time.perf_counter() + wait_s
    while tracker.in_flight and time.perf_counter() < deadline:
        if poller.poll(100):
            drain(peer, tracker)
    return time.perf_counter() - start


GATEWAY_TOML = """
instance = "bench"
[[carriers]]
name = "hgc"
bind = "tcp://127.0.0.1:*"
[security]
mode = "plaintext"
[http]
port = 0
[logging]
format = "json"
level = "warning"
[zmq]
rcvhwm = 100000
sndhwm = 100000
[backends.embedded]
type = "{backend}"
repository = "{models}"
{backend_options}
{pools}
"""
# Pools sized for a throughput run: queues deep enough for 8 frames of 100 in flight, and 8 batches in
# flight per pool (the null backend answers at once; with 2, measured, the CPU worker waits on the event
# loop and back: about 10% fewer records/s).
POOLS = (
    ("cpu", "edge_server", '["realtime", "interactive", "batch"]'),
    ("gpu-a100-mig", "cloud", '["realtime", "interactive"]'),
    ("gpu-a100", "cloud", '["interactive", "batch"]'),
)


def pool_toml(
    name: str,
    tier: str,
    models: list[str],
    *,
    priorities: str = '["realtime", "interactive", "batch"]',
    max_batch_size: int = 128,
    preferred: tuple[int, ...] = (32, 64, 128),
    max_queue_delay_us: int = 1000,
    max_queue_depth: int = 4096,
) -> str:
    """One bench pool on the ``embedded`` backend: its dispatch section and its routing entry (8 batches
    in flight, queues deep enough for 8 frames of 100 unless ``max_queue_depth`` says less)."""
    names = ", ".join(f'"{m}"' for m in models)
    sizes = ", ".join(str(p) for p in preferred)
    return f"""
[pools.{name}]
backend = "embedded"
max_batch_size = {max_batch_size}
preferred_batch_sizes = [{sizes}]
max_queue_delay_us = {max_queue_delay_us}
[[routing.pools]]
name = "{name}"
tier = "{tier}"
models = [{names}]
priorities = {priorities}
concurrency = 8
max_queue_depth = {max_queue_depth}
"""


def pools_toml(max_queue_depth: int = 4096, every_class: bool = False) -> str:
    """The pools (POOLS; ``every_class``: each taking every priority class, none kept for some)."""
    parts = [
        pool_toml(
            name,
            tier,
            ["rank-mlp", "text-encoder", "image-classifier"],
            priorities='["realtime", "interactive", "batch"]' if every_class else priorities,
            max_queue_depth=max_queue_depth,
        )
        for name, tier, priorities in POOLS
    ]
    parts.append("""
[routing.models.rank-mlp]
kind = "ranking"
[routing.models.text-encoder]
kind = "text"
[routing.models.image-classifier]
kind = "image"
""")
    return "".join(parts)


def start_gateway(
    workdir: Path,
    backend: str,
    *,
    tree: Path | None = None,
    extra_toml: str = "",
    backend_options: str = "",
    max_queue_depth: int = 4096,
    every_class: bool = False,
) -> Peer:
    """A gateway on this config (``extra_toml`` appended: more pools or models; ``backend_options``: TOML
    lines of the backend's section; ``max_queue_depth``: each pool's; ``every_class``: every pool takes
    every priority class); ``tree``: run the code of that
    checkout (cwd and PYTHONPATH set to it, e.g. the code before a change) instead of this one's."""
    models = workdir / "models"
    if not models.exists():
        from inference.models.demo import write_demo_repository

        write_demo_repository(models)
    config = workdir / f"gateway-{backend}.toml"
    config.write_text(
        GATEWAY_TOML.format(
            backend=backend,
            models=models,
            backend_options=backend_options,
            pools=pools_toml(max_queue_depth, every_class),
        )
        + extra_toml
    )
    # The ready line is logged at info; keep info on for it, warnings only would hide it.
    config.write_text(config.read_text().replace('level = "warning"', 'level = "info"'))
    return Peer(
        f"hk-gateway ({backend} backend)",
        [sys.executable, "-m", "gateway", "--config", str(config)],
        ready="stderr",
        env=None if tree is None else {"PYTHONPATH": str(tree)},
        cwd=tree,
    )


def render(runs: list[Run], args: argparse.Namespace) -> str:
    echo = {r.mode: r for r in runs if r.peer.startswith("echo")}
    rows = []
    for r in runs:
        base = echo.get(r.mode)
        ratio = f"{r.records_per_s / base.records_per_s:.2f}x" if base and base is not r else "baseline"
        top = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(r.threads.items()))
        rows.append(
            [
                r.peer,
                r.mode,
                f"{r.records_per_s:,.0f}",
                ratio,
                f"{r.p50_ms:.2f}",
                f"{r.p90_ms:.2f}",
                f"{r.p99_ms:.2f}",
                f"{r.cores_used:.2f}",
                top,
            ]
        )
    lines = [
        "## Gateway throughput and latency (issue 4)",
        "",
        f"Command: `python -m bench.gateway_bench --seconds {args.seconds:g} --write`  ",
        f"Measured {stamp()} on {machine()}. Driver, gateway and echo share the machine's cores.",
        "Throughput: frames of 100 ranking/text requests, 8 frames in flight. Latency: one realtime",
        "request per frame, open loop, measured from each request's scheduled send time. Baseline:",
        "`bench/echo.py`, a raw pyzmq ROUTER that sends every message straight back (no decoding), the floor",
        "of any Python ZeroMQ service. 'cores' = CPU seconds the peer (with its child processes) used per",
        "wall second: above 1.0 it used the second core.",
        "",
        table(
            [
                "peer",
                "mode",
                "records/s",
                "vs echo",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "cores",
                "CPU by process",
            ],
            rows,
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gateway vs raw pyzmq echo, one run")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=1000.0, help="open-loop realtime rate")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    requests = workload(2000, seed=3)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        peers: list[tuple[str, Callable[[], Peer], bool]] = [
            (
                "echo (raw pyzmq ROUTER)",
                lambda: Peer("echo (raw pyzmq ROUTER)", [sys.executable, "-m", "bench.echo"], ready="stdout"),
                False,
            ),
            ("null", lambda: start_gateway(work, "null"), True),
            ("onnx", lambda: start_gateway(work, "onnx"), True),
        ]
        health: dict[str, str] = {}
        for label, factory, is_gateway in peers:
            peer = factory()
            try:
                url = f"http://127.0.0.1:{peer.http_port}/health/carriers/hgc"
                probe = HealthProbe(url) if is_gateway else None
                runs.append(throughput(peer, requests, args.seconds, is_gateway))
                if probe is not None:
                    health[peer.name] = probe.stop()
                if label != "onnx":
                    runs.append(latency(peer, requests, args.rate, min(args.seconds, 3.0), is_gateway))
            finally:
                peer.close()
            print(f"{label}: done", file=sys.stderr)
    report = render(runs, args) + "\n\nHealth endpoint under the throughput load (one probe every 50 ms):\n"
    report += "\n".join(f"- {name}: {line}" for name, line in health.items())
    if args.json:
        print(json.dumps([asdict(r) for r in runs], indent=2))
    else:
        print(report)
    if args.write:
        update_section("gateway", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
