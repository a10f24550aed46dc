"""What a hop to an ingest shard costs per frame (issue 25, item 2: measure the candidates).

    python -m bench.shard_hop [--seconds 4] [--shards 2]

Issue 25 runs N ingest shards behind the carriers' addresses, every frame of one agent on one shard. Two
ways measured here, against the same frames and driver in the same run:

1. **direct**: the driver's DEALER talks to a shard's ROUTER itself (what "shard endpoints announced in
   the Pong" costs per frame: nothing on the way; the agent connects to the shard it was told).
2. **front**: a thin front process owns the carrier's ROUTER, reads each frame's envelope (frame 0 only,
   one upb parse) for its agent id, picks the shard (crc32 of the id modulo N) and forwards the raw frames
   with the agent's routing id prepended on a DEALER per shard; replies come back the same way.

Each shard here is a raw echo (ROUTER; every message straight back), so what differs is the hop alone. The
figure is the front's CPU per frame (from /proc, over the timed run) and the round trip's p50 / p99
against direct. Frames: a batch of 100 realistic requests (zstd, as agents send them) and a lone realtime
request. Loopback only; every loop bounded in count and time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import zmq

from edgewire import FrameCodec, pb

_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _echo(endpoint: str, stop_after_s: float) -> None:
    """A shard stand-in: every message back to its sender, unchanged."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    end = time.monotonic() + stop_after_s
    while time.monotonic() < end:
        if sock.poll(100):
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    sock.close(0)
    ctx.term()


def _front(endpoint: str, shards: list[str], stop_after_s: float) -> None:
    """The thin front: frames to the shard of their agent id, replies back to the agent."""
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(endpoint)
    backs = []
    for shard in shards:
        back = ctx.socket(zmq.DEALER)
        back.setsockopt(zmq.LINGER, 0)
        back.connect(shard)
        backs.append(back)
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    for back in backs:
        poller.register(back, zmq.POLLIN)
    envelope = pb.Envelope()
    end = time.monotonic() + stop_after_s
    while time.monotonic() < end:
        for sock, _ in poller.poll(100):
            if sock is front:
                frames = front.recv_multipart(copy=False)
                envelope.ParseFromString(frames[1].bytes)
                pick = zlib.crc32(envelope.agent_id.encode()) % len(backs)
                backs[pick].send_multipart(frames, copy=False)  # [agent routing id, envelope, payload]
            else:
                front.send_multipart(sock.recv_multipart(copy=False), copy=False)
    for sock in (front, *backs):
        sock.close(0)
    ctx.term()


def _drive(endpoint: str, frames: list[list[bytes]], seconds: float, window: int) -> tuple[int, np.ndarray]:
    """Closed loop, ``window`` frames in flight for ``seconds``: frames answered and their round trips."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sent_at: list[float] = []
    rtts: list[float] = []
    end = time.perf_counter() + seconds
    in_flight = answered = n = 0
    while time.perf_counter() < end or in_flight:
        while in_flight < window and time.perf_counter() < end:
            sock.send_multipart(frames[n % len(frames)], copy=False)
            sent_at.append(time.perf_counter())
            n += 1
            in_flight += 1
        if not sock.poll(5000):
            raise RuntimeError(f"{endpoint}: nothing back for 5 s")
        sock.recv_multipart(copy=False)
        rtts.append(time.perf_counter() - sent_at[answered])
        answered += 1
        in_flight -= 1
    sock.close(0)
    ctx.term()
    return answered, np.array(rtts) * 1e6


def _frames(batch: int, agents: int) -> list[list[bytes]]:
    from bench.gateway_bench import restamp, workload

    codec = FrameCodec()
    requests = workload(max(batch, 200), 11)
    out = []
    for n in range(64):
        chunk = [requests[(n * batch + k) % len(requests)] for k in range(batch)]
        restamp(chunk, 30.0)
        out.append(
            codec.encode(pb.RequestBatch(requests=chunk), agent_id=f"edge-{n % agents}", region="us-west")
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--shards", type=int, default=2)
    args = parser.parse_args(argv)
    from gateway.testing_servers import free_port

    spawn = multiprocessing.get_context("spawn")
    life = 4 * args.seconds + 30
    shards = [f"tcp://127.0.0.1:{free_port()}" for _ in range(args.shards)]
    front_endpoint = f"tcp://127.0.0.1:{free_port()}"
    workers = [spawn.Process(target=_echo, args=(s, life), daemon=True) for s in shards]
    front = spawn.Process(target=_front, args=(front_endpoint, shards, life), daemon=True)
    for p in (*workers, front):
        p.start()
    time.sleep(1.0)
    print("| frames | path | frames/s | p50 us | p99 us | front CPU per frame, us |", flush=True)
    print("|---|---|---|---|---|---|")
    for label, batch, window in (("batch of 100 (zstd)", 100, 8), ("lone realtime request", 1, 1)):
        frames = _frames(batch, agents=16)
        _drive(shards[0], frames, 0.5, window)  # warm both paths
        _drive(front_endpoint, frames, 0.5, window)
        for path, endpoint in (("direct to a shard", shards[0]), ("through the front", front_endpoint)):
            assert front.pid is not None
            before = _cpu(front.pid)
            started = time.perf_counter()
            answered, rtts = _drive(endpoint, frames, args.seconds, window)
            elapsed = time.perf_counter() - started
            front_us = (_cpu(front.pid) - before) / answered * 1e6
            p50, p99 = np.percentile(rtts, [50, 99])
            shown = f"{front_us:.1f}" if endpoint == front_endpoint else "-"
            print(
                f"| {label} | {path} | {answered / elapsed:,.0f} | {p50:.0f} | {p99:.0f} | {shown} |",
                flush=True,
            )
    for p in (*workers, front):
        p.terminate()
        p.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
