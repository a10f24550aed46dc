"""Replay at max speed as a load test: a committed capture against a gateway, with a same-run baseline.

    python -m bench.replay_bench [--capture FILE...] [--times 5] [--write]

The capture (default: tests/replay/cases/synthetic-mixed, 1,200 requests of every kind and region) is
replayed ``--times`` times back to back with new ids at ``--speed max`` (a window of 2,000 requests in
flight), by the same code as ``hk-gateway replay``:

* sink (baseline): a raw pyzmq ROUTER that reads and discards: the replay driver's own ceiling
  (decode the capture, re-encode, send), with nothing answering;
* hk-gateway, null backend: ingest, routing, batching, CPU pipelines and replies, no model cost;
* hk-gateway, embedded ONNX backend: the demo models on this machine's CPUs.

The gateways run as separate processes (``python -m gateway --config ...``, as in bench.gateway_bench).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq

from bench.gateway_bench import start_gateway
from bench.report import machine, stamp, table, update_section
from gateway.capture.format import SUFFIX
from gateway.capture.replay import ReplayOptions, ReplaySummary, replay

DEFAULT_CASE = Path(__file__).resolve().parent.parent / "tests" / "replay" / "cases" / "synthetic-mixed"


@dataclass
class Run:
    target: str
    summary: ReplaySummary


class Sink:
    """A ROUTER on loopback that reads everything and answers nothing (the baseline)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.messages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(100):
                self.sock.recv_multipart()
                self.messages += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


async def one(target: str, endpoint: str, files: list[Path], answered: bool) -> Run:
    options = ReplayOptions(
        endpoint=endpoint,
        speed=None,
        window=2000 if answered else 10**9,
        timeout_s=30.0 if answered else 0.0,
    )
    summary, _ = await replay(files, options)
    if not answered:
        summary.lost = 0  # nothing answers the sink: its figure is the send rate
    return Run(target, summary)


def render(runs: list[Run], files: list[Path], times: int) -> str:
    base = runs[0].summary.requests_per_s
    rows = [
        [
            run.target,
            f"{run.summary.requests_sent:,}",
            f"{run.summary.seconds:.2f}",
            f"{run.summary.requests_per_s:,.0f}",
            f"{run.summary.requests_per_s / base:.2f}",
            f"{run.summary.latency_ms.get('p50', 0):.1f} / {run.summary.latency_ms.get('p99', 0):.1f}"
            if run.summary.latency_ms
            else "-",
            ", ".join(f"{k} {v}" for k, v in sorted(run.summary.answered_by_status.items())) or "-",
            str(run.summary.lost),
        ]
        for run in runs
    ]
    header = ["target", "requests", "seconds", "requests/s", "vs sink", "p50 / p99 ms", "answered", "lost"]
    return (
        "## Replay at max speed (issue 7)\n\n"
        f"{stamp()} on {machine()}. Capture: {', '.join(p.parent.name + '/' + p.name for p in files[:1])} "
        f"replayed {times} times with new ids, window 2,000.\n"
        "Reproduce: `python -m bench.replay_bench --write`.\n\n" + table(header, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", type=Path, nargs="*", default=None)
    parser.add_argument("--times", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    captured = args.capture or sorted(DEFAULT_CASE.glob(f"*{SUFFIX}"))
    files = captured * args.times
    runs: list[Run] = []
    sink = Sink()
    try:
        runs.append(
            asyncio.run(one("sink (raw pyzmq ROUTER, baseline)", sink.endpoint, files, answered=False))
        )
    finally:
        sink.close()
    with tempfile.TemporaryDirectory() as scratch:
        for backend in ("null", "onnx"):
            peer = start_gateway(Path(scratch), backend)
            try:
                label = f"hk-gateway, {'null' if backend == 'null' else 'embedded ONNX'} backend"
                runs.append(asyncio.run(one(label, peer.endpoint, files, answered=True)))
            finally:
                peer.close()
    body = render(runs, captured, args.times)
    print(body)
    if args.write:
        update_section("replay", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
