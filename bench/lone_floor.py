"""The floor under a lone realtime request in Python: the least the gateway's libraries cost per request.

    python -m bench.lone_floor [--requests 3000] [--rounds 3]

Beside ``bench.lone_profile`` (the gateway on its loop, one request at a time), with the same client, the
same requests (issue 24's mix: 60% ranking of 8-32 candidates, 40% short text, realtime, one per frame)
and the same answers on the wire, three handlers on a blocking ROUTER in this process's main thread,
nothing else on it (no event loop, screening, dedupe, routing, queueing, batching, metrics or Acks):

- ``wire``: receive, decode the envelope, decompress and parse the RequestBatch, answer OK with an empty
  output (a ResponseBatch framed and compressed as the gateway frames it), send.
- ``pipelines``: ``wire`` plus the request's CPU-stage pipeline, as the gateway calls it on its loop
  (``worker.prepare_requests`` with the request's bytes, the null backend's outputs, ``finish_batch``).
- ``gateway``: the gateway itself (``bench.lone_profile``'s in-process gateway, null backend).

Printed: the main thread's CPU per request (``time.thread_time``) of each, round by round, the three
taking turns. What ``pipelines`` costs is what any Python gateway with these libraries pays per lone
request before doing any of its own work: the issue's 60 us goal is measured against it. Loopback only;
bounded by ``--requests``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from bench.gateway_bench import FEATURES
from bench.lone_profile import client
from edgewire import FrameCodec, Serialized, pb, repeated_field
from edgewire.parts import recv_parts, send_parts
from gateway.frames.wire import request_spans
from inference.backends.base import ModelSpec
from inference.backends.modelrepo import spec_from_config
from inference.models.demo import demo_config
from inference.pipeline import worker

WARM_UP = 300
PIPELINES = {"rank-mlp": "ranking", "text-encoder": "text"}
OK_HEAD = pb.InferResponse(status=pb.STATUS_OK).SerializeToString()
RESPONSES_FIELD = pb.ResponseBatch.DESCRIPTOR.fields_by_name["responses"].number
LONE_PROFILE_LINE = re.compile(r"gateway loop thread ([0-9.]+) us CPU per request")

Handler = Callable[[pb.InferRequest, memoryview], bytes]


def _specs() -> dict[str, ModelSpec]:
    return {
        model: spec_from_config(demo_config(model), "1", Path(model) / "config.pbtxt") for model in PIPELINES
    }


def _outputs(spec: ModelSpec, rows: int) -> dict[str, np.ndarray]:
    """The null backend's answer: zeros of the model's output shapes."""
    return {o.name: np.zeros((rows, *o.dims), np.float32) for o in spec.outputs}


def wire_only(request: pb.InferRequest, raw: memoryview) -> bytes:
    return b"".join((b"\x0a\x10", request.request_id, OK_HEAD))


def with_pipelines(specs: dict[str, ModelSpec]) -> Handler:
    def handle(request: pb.InferRequest, raw: memoryview) -> bytes:
        model = request.model_name
        spec, pipeline = specs[model], PIPELINES[model]
        prepared = worker.prepare_requests(pipeline, spec, [request], [raw])
        rows = prepared.rows[-1].stop if pipeline == "ranking" else len(prepared.kept)
        (output,) = worker.finish_batch(pipeline, prepared, _outputs(spec, rows))
        return b"".join((b"\x0a\x10", request.request_id, OK_HEAD, output))

    return handle


def serve(n: int, handle: Handler) -> float:
    """Serve ``n`` lone requests from ``bench.lone_profile.client``; the main thread's CPU per request."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    codec = FrameCodec()
    statuses: list[int] = []
    thread = threading.Thread(
        target=client, args=(f"tcp://127.0.0.1:{port}", n, FEATURES, statuses), daemon=True
    )
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    answered = 0
    thread.start()
    cpu = time.thread_time()
    try:
        while answered < n:
            if not poller.poll(10_000):
                raise RuntimeError(f"no request for 10 s after {answered}")
            frames = recv_parts(sock)
            body = [f.buffer for f in frames[1:]]
            envelope = codec.decode_envelope(body)
            batch, raw = codec.decode_payload_bytes(envelope, body[1])
            assert isinstance(batch, pb.RequestBatch)
            payload = memoryview(raw)
            spans = request_spans(payload, batch.requests) or [payload]
            answers = [handle(r, s) for r, s in zip(batch.requests, spans, strict=True)]
            out = codec.encode(
                Serialized(
                    pb.MESSAGE_KIND_RESPONSE_BATCH, repeated_field(RESPONSES_FIELD, answers), len(answers)
                ),
                agent_id=envelope.agent_id,
                region="hk",
                dict_id=0,
            )
            send_parts(sock, [frames[0], *out])
            answered += len(answers)
        cpu = time.thread_time() - cpu
    finally:
        thread.join(timeout=10)
        sock.close(0)
        ctx.term()
    if len(statuses) != n or any(s != pb.STATUS_OK for s in statuses):
        raise RuntimeError(f"{len(statuses)} of {n} answered OK")
    return cpu / n * 1e6


def gateway_cpu(n: int) -> float:
    """``bench.lone_profile``'s figure for the gateway (its loop thread's CPU per request), from its own
    process (its gateway starts CPU workers and a forkserver: not in this one)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.lone_profile", "--requests", str(n)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = LONE_PROFILE_LINE.search(out)
    if found is None:
        raise RuntimeError(f"bench.lone_profile printed no figure: {out[-500:]!r}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    specs = _specs()
    handlers: dict[str, Handler] = {"wire": wire_only, "pipelines": with_pipelines(specs)}
    results: dict[str, list[float]] = {name: [] for name in (*handlers, "gateway")}
    for _ in range(args.rounds):
        for name, handle in handlers.items():
            serve(WARM_UP, handle)
            results[name].append(serve(args.requests, handle))
        results["gateway"].append(gateway_cpu(args.requests))
        print(", ".join(f"{name} {values[-1]:.1f}" for name, values in results.items()), "us", flush=True)
    print(f"main-thread CPU per lone realtime request, median of {args.rounds} rounds:")
    for name, values in results.items():
        print(f"  {name:<10} {statistics.median(values):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
