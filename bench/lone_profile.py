"""Where a lone realtime request's gateway CPU goes: an in-process gateway, one request at a time.

    python -m bench.lone_profile [--requests 3000] [--profile | --steps [--detail N]] [--features 0|1]
                                 [--frame 100 [--window 8]]

The gateway (null backend, bench/gateway_bench.py's config) runs on this process's event loop; a plain
DEALER on another thread sends issue 24's mix (60% ranking of 8-32 candidates, 40% short text) one
realtime request per frame and waits for each answer before the next. The main thread's CPU time is then
the gateway's alone: printed per request, and with ``--profile`` a cProfile of that thread (by own time and
by cumulative time) and the Python calls per request, exact where CPU per request swings from run to run.
``--features 0`` sends frames that do not ask for Acks with answers. ``--frame N``
(N > 1) sends frames of N requests of the mix instead (issue 24's batched frames: bench/frame_path.py's
``mixed_requests``, encoded before the run), ``--window`` of them in flight: CPU per record. Loopback only;
bounded by ``--requests``.

``--short-text-tokens 16`` queues a model's texts of up to 16 tokens in one queue (the pools'
``short_text_tokens``; the mix's short texts then go in about one backend call per frame instead of four
or five). ``--max-queue-delay-us`` sets the bench pools' ``max_queue_delay_us`` (1000 by default) and
``--realtime-as-interactive`` sends the mix's realtime requests as interactive ones, with ``--frame``: a
queue holding a realtime request is cut at once (``realtime_queue_delay_us = 0``), so together they show
what a backend call costs the loop whatever its size (the runs print backend calls per frame).

``--steps``: where that CPU goes per step, in microseconds per request (bench/steps.py), without cProfile's
inflation: the timed part runs twice, first as it is, then with py-spy sampling the loop thread about 1,000
times a second from outside the interpreter (non-blocking); each busy sample goes to one step (receive &
decode, screening, routing, queueing, CPU stage prepare and finish per pipeline kind, backend call,
answers, replies & send, metrics, C under the loop (uvloop's and the kernel's), other), and each step's
share of the samples is scaled to the first run's CPU per request. Both runs' CPU per request are
printed: their difference is what sampling cost the thread (and this machine's noise).

``--at-once-turns N``: the least noisy measure of serving a lone realtime request at once
(PoolDispatcher.serve_at_once) this machine allows: one gateway, N rounds of ``--requests`` lone requests
each with it on and with it off (the bench replaces ``serves_at_once`` by a refusal), the two in turns
(on first in even rounds); each block's loop CPU per request and the per-round difference are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import pstats
import statistics
import tempfile
import threading
import time
from pathlib import Path

import uvloop
import zmq

from bench.frame_path import copies, mixed_requests
from bench.gateway_bench import FEATURES, GATEWAY_TOML, pools_toml, restamp
from bench.ingest_bench import prebuild
from bench.steps import StackSampler, per_step, table
from edgewire import FrameCodec, pb
from gateway.config import load_config
from gateway.dispatch.pool import PoolDispatcher
from gateway.dispatch.work import WorkItem
from gateway.server import Gateway
from inference.models.demo import write_demo_repository

WARM_UP = 300
REALTIME = pb.PRIORITY_CLASS_REALTIME


def client(endpoint: str, n: int, features: int, statuses: list[int]) -> None:
    """Send ``n`` lone realtime requests, each after the previous one's answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)  # a lost answer ends the run instead of hanging it
    sock.connect(endpoint)
    codec = FrameCodec()
    requests = copies(mixed_requests(1, 4))
    try:
        for i in range(n):
            request = requests[i % len(requests)]
            request.priority = pb.PRIORITY_CLASS_REALTIME
            restamp([request], 5.0)
            batch = pb.RequestBatch(requests=[request])
            sock.send_multipart(
                codec.encode(batch, agent_id="lone", region="us-west", priority=REALTIME, features=features)
            )
            while True:
                payload = codec.decode(sock.recv_multipart()).payload
                if isinstance(payload, pb.ResponseBatch) and payload.responses:
                    statuses.append(payload.responses[0].status)
                    break
    finally:
        sock.close(0)
        ctx.term()


def batched_client(
    endpoint: str, n: int, frame: int, window: int, statuses: list[int], realtime_as_interactive: bool = False
) -> None:
    """Send ``n`` requests in frames of ``frame`` (encoded first), ``window`` frames in flight;
    ``realtime_as_interactive``: the mix's realtime requests sent as interactive ones."""
    templates = mixed_requests(2, min(40, max(1, -(-n // 100))))  # cycled, fresh ids per frame
    if realtime_as_interactive:
        for request in templates:
            if request.priority == REALTIME:
                request.priority = pb.PRIORITY_CLASS_INTERACTIVE
    frames = prebuild(copies(templates), -(-n // frame), batch=frame)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    codec = FrameCodec()
    total = sum(codec.decode(f).envelope.record_count for f in frames)
    sent = 0
    try:
        while len(statuses) < total:
            while sent < len(frames) and sent * frame - len(statuses) < window * frame:
                sock.send_multipart(frames[sent])
                sent += 1
            payload = codec.decode(sock.recv_multipart()).payload
            if isinstance(payload, pb.ResponseBatch):
                statuses.extend(r.status for r in payload.responses)
    finally:
        sock.close(0)
        ctx.term()


async def start(
    work: Path, max_queue_delay_us: int = 1000, short_text_tokens: int = 0
) -> tuple[Gateway, str]:
    """The bench's gateway (null backend) on this loop, and its first carrier's endpoint; every pool with
    ``short_text_tokens`` (docs/GATEWAY.md)."""
    models = work / "models"
    write_demo_repository(models)
    config = work / "gateway.toml"
    pools = pools_toml().replace(
        "max_queue_delay_us = 1000",
        f"max_queue_delay_us = {max_queue_delay_us}\nshort_text_tokens = {short_text_tokens}",
    )
    config.write_text(GATEWAY_TOML.format(backend="null", models=models, backend_options="", pools=pools))
    gateway = Gateway(load_config(config, environ={}))
    await gateway.start()
    return gateway, next(iter(gateway.carriers.values())).endpoint


async def run(
    requests: int,
    features: int,
    profile: bool,
    work: Path,
    frame: int = 1,
    window: int = 8,
    steps: bool = False,
    detail: int = 0,
    max_queue_delay_us: int = 1000,
    realtime_as_interactive: bool = False,
    short_text_tokens: int = 0,
) -> None:
    gateway, endpoint = await start(work, max_queue_delay_us, short_text_tokens)
    loop = asyncio.get_running_loop()
    runs = [(WARM_UP, False, False), (requests, True, False)]
    if steps:
        runs.append((requests, True, True))
    unsampled_us = 0.0
    try:
        for n, timed, sampled in runs:
            statuses: list[int] = []
            done = asyncio.Event()

            def drive(n: int = n, statuses: list[int] = statuses, done: asyncio.Event = done) -> None:
                try:
                    if frame > 1:
                        batched_client(endpoint, n, frame, window, statuses, realtime_as_interactive)
                    else:
                        client(endpoint, n, features, statuses)
                finally:
                    loop.call_soon_threadsafe(done.set)

            thread = threading.Thread(target=drive, daemon=True)
            profiler = cProfile.Profile() if timed and profile else None
            sampler = StackSampler(threading.get_native_id()) if sampled else None
            calls = backend_calls(gateway)
            cpu, wall = time.thread_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            with sampler or contextlib.nullcontext():
                thread.start()
                await done.wait()
            if profiler is not None:
                profiler.disable()
            if not timed:
                continue
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            calls = backend_calls(gateway) - calls  # after the timed part: a collection flushes the tally
            ok = sum(1 for s in statuses if s == pb.STATUS_OK)
            what = "lone realtime requests" if frame == 1 else f"requests in frames of {frame}"
            cpu_us = cpu / len(statuses) * 1e6
            how = " (profiled)" if profiler else f" (sampled, {sampler.taken} samples)" if sampler else ""
            print(
                f"{n} {what}, {len(statuses)} answered ({ok} OK): gateway loop thread "
                f"{cpu_us:.1f} us CPU per request{how}, wall {wall / len(statuses) * 1e6:.1f} us, "
                f"{calls / (len(statuses) / frame):.2f} backend calls per frame"
            )
            if sampler is not None:
                print(
                    f"sampler's cost: {cpu_us - unsampled_us:+.1f} us CPU per request "
                    f"({cpu_us / unsampled_us - 1:+.1%}) over the unsampled run (the table's scale)\n"
                )
                print(table(per_step(sampler.stacks), unsampled_us, detail=detail))
            else:
                unsampled_us = cpu_us
            if profiler is not None:
                stats = pstats.Stats(profiler)
                # Exact where CPU per request swings by 10% on a shared machine: compare two trees by it.
                total: int = stats.total_calls  # type: ignore[attr-defined]  # set by pstats, not in its stubs
                print(f"Python calls per request (cProfile): {total / len(statuses):.1f}\n")
                stats.sort_stats("tottime").print_stats(40)
                stats.sort_stats("cumulative").print_stats(80)
    finally:
        await gateway.drain()
        await gateway.aclose()


async def at_once_turns(requests: int, features: int, work: Path, rounds: int) -> None:
    """``--at-once-turns``: lone requests in blocks, serving at once on and off in turns (module doc)."""
    gateway, endpoint = await start(work)
    loop = asyncio.get_running_loop()
    serves_at_once = PoolDispatcher.serves_at_once

    def refused(self: PoolDispatcher, items: list[WorkItem]) -> bool:
        return False

    async def block(n: int, on: bool) -> float:
        PoolDispatcher.serves_at_once = serves_at_once if on else refused  # type: ignore[method-assign]
        statuses: list[int] = []
        done = asyncio.Event()

        def drive() -> None:
            try:
                client(endpoint, n, features, statuses)
            finally:
                loop.call_soon_threadsafe(done.set)

        thread = threading.Thread(target=drive, daemon=True)
        cpu = time.thread_time()
        thread.start()
        await done.wait()
        thread.join()
        if any(s != pb.STATUS_OK for s in statuses):
            raise RuntimeError(f"answers not OK: {sorted(set(statuses))}")
        return (time.thread_time() - cpu) / len(statuses) * 1e6

    figures: dict[bool, list[float]] = {True: [], False: []}
    try:
        await block(WARM_UP, True)
        await block(WARM_UP, False)
        for round_ in range(rounds):
            for on in (True, False) if round_ % 2 == 0 else (False, True):
                figures[on].append(await block(requests, on))
            print(
                f"round {round_ + 1}: at once {figures[True][-1]:.1f}, queued {figures[False][-1]:.1f} us "
                "of loop CPU per lone request",
                flush=True,
            )
    finally:
        PoolDispatcher.serves_at_once = serves_at_once  # type: ignore[method-assign]
        await gateway.drain()
        await gateway.aclose()
    gains = [off - on for on, off in zip(figures[True], figures[False], strict=True)]
    print(
        f"median of {rounds} rounds: at once {statistics.median(figures[True]):.1f}, queued "
        f"{statistics.median(figures[False]):.1f} us; queued - at once per round: median "
        f"{statistics.median(gains):.1f} us (least {min(gains):.1f}, most {max(gains):.1f})"
    )


def backend_calls(gateway: Gateway) -> float:
    """Backend calls so far, every pool's (``hkgw_batch_size``'s observations)."""
    return sum(
        sample.value
        for metric in gateway.metrics.registry.collect()
        if metric.name == "hkgw_batch_size"
        for sample in metric.samples
        if sample.name == "hkgw_batch_size_count"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--profile", action="store_true", help="a cProfile of the loop thread (inflated)")
    how.add_argument("--steps", action="store_true", help="sampled CPU per step (bench/steps.py)")
    parser.add_argument("--features", type=int, choices=(0, 1), default=1)
    parser.add_argument("--frame", type=int, default=1, help="requests per frame (1: lone realtime)")
    parser.add_argument("--window", type=int, default=8, help="frames in flight, with --frame > 1")
    parser.add_argument("--detail", type=int, default=0, help="with --steps: the top N frames of each step")
    parser.add_argument("--max-queue-delay-us", type=int, default=1000, help="the pools' batching delay")
    parser.add_argument(
        "--realtime-as-interactive", action="store_true", help="with --frame > 1: no realtime requests"
    )
    parser.add_argument(
        "--short-text-tokens",
        type=int,
        default=0,
        help="the pools' short_text_tokens (16: a frame's short texts in one queue per model)",
    )
    parser.add_argument(
        "--at-once-turns", type=int, default=0, help="rounds of lone requests served at once and queued"
    )
    args = parser.parse_args(argv)
    features = FEATURES if args.features else 0
    if args.at_once_turns:
        with tempfile.TemporaryDirectory() as work:
            uvloop.run(at_once_turns(args.requests, features, Path(work), args.at_once_turns))
        return 0
    with tempfile.TemporaryDirectory() as work:
        uvloop.run(
            run(
                args.requests,
                features,
                args.profile,
                Path(work),
                args.frame,
                args.window,
                args.steps,
                args.detail,
                args.max_queue_delay_us,
                args.realtime_as_interactive,
                args.short_text_tokens,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
