"""The tensor path's copies, counted inside one tree's code: run as a script by bench/tensor_path.py.

    python -P bench/tensor_probe.py   (cwd and PYTHONPATH = the tree under test; prints one JSON object)

Frames of ResNet-50 inputs (FP16 [1, 3, 224, 224], 301,056 bytes of raw_data each) are sent over ZeroMQ
on loopback and received as the gateway receives them (``copy=False``: the payload is the zmq.Frame's
buffer), decoded with the tree's codec, and prepared by the tree's ``CpuStage`` as its pool prepares a
batch: with the requests' bytes in the frame where its ``prepare`` takes them (``payloads``), without them
where it does not (the code before issue 24 item 3). For each batch size: the bytes allocated at the peak
of ``prepare`` (tracemalloc: Python objects and numpy arrays), whether the batch's array is the frame's
memory, and the event loop's CPU per request of the step (``time.thread_time``, the best of several
rounds of calls).

It imports only the packages under test (gateway, edgewire, inference) and numpy and pyzmq, inside
``main``, so that the tree's own code is what runs; the JSON names the files they came from.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

BATCH_SIZES = (1, 4, 16)  # 16 x 301 KB: within the 8 MiB frame limit
ROUNDS, CALLS = 9, 16  # prepare calls timed per batch size: the best round counts (the machine is shared)
IMAGE = (1, 3, 224, 224)


def main() -> int:
    import numpy as np
    import zmq

    import edgewire
    import gateway.dispatch.cpu as cpu_module
    import inference.pipeline.tensor as tensor_module
    from edgewire import FrameCodec, new_id, pb
    from gateway.dispatch.cpu import CpuStage
    from gateway.ops.metrics import GatewayMetrics
    from inference.backends.base import ModelSpec, TensorSpec

    spec = ModelSpec(
        "resnet50",
        "1",
        (TensorSpec("pixels", "float16", IMAGE[1:]),),
        (TensorSpec("logits", "float32", (1000,)),),
        128,
        "tensor",
    )
    takes_payloads = "payloads" in inspect.signature(CpuStage.prepare).parameters
    codec = FrameCodec()
    context = zmq.Context()
    sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    port = receiver.bind_to_random_port("tcp://127.0.0.1")
    sender.connect(f"tcp://127.0.0.1:{port}")
    receiver.setsockopt(zmq.RCVTIMEO, 10_000)
    stage = CpuStage(1, "process", GatewayMetrics(()))  # tensor batches run on the loop: never started
    rng = np.random.default_rng(24)
    results: list[dict[str, Any]] = []

    async def prepare(requests: Sequence[Any], payloads: list[memoryview] | None) -> Any:
        if payloads is None:
            return await stage.prepare("tensor", spec, requests)
        return await stage.prepare("tensor", spec, requests, payloads=payloads)

    async def measure() -> None:
        for size in BATCH_SIZES:
            requests = [
                pb.InferRequest(
                    request_id=new_id(),
                    model_name="resnet50",
                    kind=pb.REQUEST_KIND_TENSOR,
                    inputs=[
                        tensor_module.tensor_from_array(
                            "pixels", rng.standard_normal(IMAGE).astype(np.float16)
                        )
                    ],
                )
                for _ in range(size)
            ]
            frames = codec.encode(pb.RequestBatch(requests=requests), agent_id="probe", compress=False)
            sender.send_multipart(frames, copy=False)
            header, body = receiver.recv_multipart(copy=False)
            envelope = codec.decode_envelope([header.buffer, body.buffer])
            payloads = None
            if takes_payloads:
                batch, raw = codec.decode_payload_bytes(envelope, body.buffer)
                payloads = request_payloads(raw)
            else:
                batch = codec.decode_payload(envelope, body.buffer)
            assert isinstance(batch, pb.RequestBatch)
            received = list(batch.requests)
            raw_bytes = sum(len(r.inputs[0].raw_data) for r in received)
            tracemalloc.start()
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            prepared = await prepare(received, payloads)
            peak = tracemalloc.get_traced_memory()[1] - before
            tracemalloc.stop()
            pixels = prepared.inputs["pixels"]
            frame = np.frombuffer(body.buffer, np.uint8)
            expected = np.concatenate([np.frombuffer(r.inputs[0].raw_data, "<f2") for r in requests])
            rounds = []
            for _ in range(ROUNDS):
                started = time.thread_time()
                for _ in range(CALLS):
                    await prepare(received, payloads)
                rounds.append((time.thread_time() - started) / CALLS)
            cpu = min(rounds)
            results.append(
                {
                    "requests": size,
                    "raw_bytes": raw_bytes,
                    "peak_bytes": peak,
                    "shares_frame": bool(np.shares_memory(pixels, frame)),
                    "writeable": bool(pixels.flags.writeable),
                    "equal": bool(np.array_equal(pixels.reshape(-1), expected)),
                    "cpu_us_per_request": cpu / size * 1e6,
                }
            )

    try:
        asyncio.run(measure())
    finally:
        sender.close(0)
        receiver.close(0)
        context.term()
    files = {m.__name__: m.__file__ for m in (edgewire, cpu_module, tensor_module)}
    print(json.dumps({"files": files, "takes_payloads": takes_payloads, "batches": results}))
    return 0


def request_payloads(raw: Any) -> list[memoryview]:
    """Each request's bytes in a RequestBatch payload (field 1), as the gateway finds them: views."""
    from edgewire.scan import fields

    return [f.data for f in fields(raw) if f.number == 1]


if __name__ == "__main__":
    sys.exit(main())
