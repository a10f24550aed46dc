"""GPU tier on a real GPU: BERT-base and ResNet-50 behind the gateway vs. called directly, batch sizes 1..128.

    python3 -m bench.gpu_tier --out DIR [--seconds 5] [--batches 1,8,32,64,128] [--write]
    python3 -m bench.gpu_tier --backend null --out DIR     # the harness alone, no GPU (zeros, no model)

Both models have random weights built from their configs (``gateway.models.gpu``; nothing is downloaded)
and run in fp16 on ``cuda:0`` through the gateway's ``torch`` backend.

* direct: the same model object called in this process at batch size b: numpy inputs -> device -> model ->
  outputs on the host, back to back, as many as fit in ``--seconds`` (bounded in count too).
* gateway: a real gateway on loopback whose one cloud pool has ``max_batch_size = b`` (preferred size b,
  5 ms queue delay) on that backend; the driver keeps ``3 b`` single-item requests in flight, each with a
  100 ms deadline, over ZeroMQ in frames of up to 8 (as an agent batches them, zstd-compressed), from a
  driver process of its own. Throughput counts answers that came back OK within their deadline; p50/p99
  are the request latencies the driver saw.
* ratio: gateway items/s at b over direct items/s at b = 128 (the issue's goal: >= 0.8 within 100 ms).

``--out`` gets ``gpu_tier.json`` and ``gpu_tier.md``; ``--write`` also updates docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import json
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import text_format

from bench.report import machine, table, update_section
from edgewire import new_id, now_unix_us, pb
from gateway.config import default_section, validate
from gateway.testing import WireClient, loopback_overrides, run_gateway
from inference.backends.base import ModelSpec
from inference.backends.modelrepo import config_from_spec
from inference.pipeline.tensor import tensor_from_array
from service.configfile import merge_tables
from service.runtime import run_main

MODELS = {"bert-base": "gateway.models.gpu:bert_base", "resnet50": "gateway.models.gpu:resnet50"}
DEADLINE_S = 0.1
MAX_DIRECT_CALLS = 20_000


@dataclass
class Point:
    model: str
    batch: int
    direct_items_per_s: float
    gateway_items_per_s: float
    gateway_ok: int
    gateway_late_or_failed: int
    gateway_p50_ms: float
    gateway_p99_ms: float
    gateway_mean_batch: float


def example_inputs(spec: ModelSpec, rows: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Inputs of the spec's shapes: token ids for int64 inputs (all ones for masks), noise for floats."""
    out = {}
    for tensor in spec.inputs:
        shape = (rows, *tensor.dims)
        if tensor.dtype == "int64":
            ids = rng.integers(1000, 30000, shape, dtype=np.int64)
            out[tensor.name] = np.ones(shape, np.int64) if "mask" in tensor.name else ids
        else:
            out[tensor.name] = rng.standard_normal(shape).astype(tensor.dtype)
    return out


def direct_rate(
    call: Callable[[dict[str, np.ndarray]], Any], spec: ModelSpec, batch: int, seconds: float
) -> float:
    """Items per second calling the model in-process at one batch size (after 3 warm-up calls)."""
    feed = example_inputs(spec, batch, np.random.default_rng(batch))
    for _ in range(3):
        call(feed)
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds and calls < MAX_DIRECT_CALLS:
        call(feed)
        calls += 1
    return calls * batch / (time.perf_counter() - started)


def gateway_overrides(model: str, backend: dict[str, Any], batch: int) -> dict[str, Any]:
    """One cloud pool serving one model from ``backend``, batching to ``batch``."""
    return {
        "backends": {"gpu": backend},
        "pools": {
            "gpu": {
                "backend": "gpu",
                "max_batch_size": batch,
                "preferred_batch_sizes": [batch],
                "max_queue_delay_us": 5000,
            }
        },
        "routing": {
            "models": {model: {"kind": "tensor"}},
            "pools": [
                {
                    "name": "gpu",
                    "tier": "cloud",
                    "models": [model],
                    "priorities": ["realtime", "interactive", "batch"],
                    "speed": 50.0,
                    "concurrency": 2,
                    "max_queue_depth": max(64, 8 * batch),
                }
            ],
        },
        "limits": {"max_frame_bytes": 64 << 20, "max_decompressed_bytes": 64 << 20},
        "logging": {"format": "json", "level": "error"},
    }


async def drive(
    endpoint: str, requests: list[pb.InferRequest], inflight: int, seconds: float, frame_size: int = 8
) -> dict[str, Any]:
    """Keep ``inflight`` requests outstanding for ``seconds``, sent in frames of up to ``frame_size`` (as an
    agent batches them); count the answers that came back OK within their deadline."""
    latencies: list[float] = []
    ok = failed = 0
    errors: Counter[str] = Counter()
    examples: list[str] = []
    sent_at: dict[bytes, float] = {}
    async with WireClient(endpoint, agent_id="gpu-bench") as client:
        started = time.perf_counter()
        i = 0
        while True:
            now = time.perf_counter()
            sending = now - started < seconds
            while sending and len(sent_at) < inflight:
                frame = []
                for _ in range(min(frame_size, inflight - len(sent_at))):
                    request = pb.InferRequest()
                    request.CopyFrom(requests[i % len(requests)])
                    i += 1
                    request.request_id = new_id()
                    request.deadline_unix_us = now_unix_us() + int(DEADLINE_S * 1e6)
                    sent_at[request.request_id] = time.perf_counter()
                    frame.append(request)
                await client.send(frame, priority=pb.PRIORITY_CLASS_INTERACTIVE)
            if not sent_at or now - started > seconds + 5:
                break
            await client.receive_one(0.05)
            for rid in [r for r in client.responses if r in sent_at]:
                response = client.responses.pop(rid)
                latency = time.perf_counter() - sent_at.pop(rid)
                if response.status == pb.STATUS_OK and latency <= DEADLINE_S:
                    ok += 1
                    latencies.append(latency)
                else:
                    failed += 1
                    errors[
                        pb.Status.Name(response.status) if response.status != pb.STATUS_OK else "LATE"
                    ] += 1
                    if len(examples) < 3 and response.error_message:
                        examples.append(response.error_message)
            client.acks.clear()
        elapsed = min(time.perf_counter() - started, seconds)
    lat = np.array(latencies or [float("nan")]) * 1e3
    return {
        "ok": ok,
        "failed": failed + len(sent_at),
        "items_per_s": ok / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "errors": dict(errors),
        "examples": examples,
    }


def drive_in_process(
    endpoint: str, model: str, spec: ModelSpec, inflight: int, seconds: float
) -> dict[str, Any]:
    """:func:`drive` with 64 distinct requests of the model, in the calling (driver) process."""
    return asyncio.run(drive(endpoint, wire_requests(model, spec, 64), inflight, seconds))


def wire_requests(model: str, spec: ModelSpec, n: int) -> list[pb.InferRequest]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        inputs = example_inputs(spec, 1, rng)
        request = pb.InferRequest(model_name=model, kind=pb.REQUEST_KIND_TENSOR, complexity_hint=1.0)
        request.inputs.extend(tensor_from_array(name, array) for name, array in inputs.items())  # [1, ...]
        out.append(request)
    return out


async def gateway_point(model: str, spec: ModelSpec, backend: dict[str, Any], batch: int, seconds: float,
                        models_dir: Path, drivers: Executor) -> tuple[dict[str, Any], float]:  # fmt: skip
    raw = default_section()
    for key in ("carriers", "backends", "pools"):  # this gateway has only its own, like a config file
        raw.pop(key, None)
    raw["routing"] = {}
    loopback = loopback_overrides(models_dir)
    loopback.pop("backends")
    config = validate(merge_tables(merge_tables(raw, loopback), gateway_overrides(model, backend, batch)))
    loop = asyncio.get_running_loop()
    async with run_gateway(config) as gw:
        endpoint = gw.endpoint("hgc")
        # The driver runs in a process of its own: encoding and compressing megabytes of tensors per frame
        # on the gateway's event loop would be measured as the gateway's cost.
        await loop.run_in_executor(
            drivers, drive_in_process, endpoint, model, spec, 3 * batch, min(1.0, seconds)
        )
        result = await loop.run_in_executor(
            drivers, drive_in_process, endpoint, model, spec, 3 * batch, seconds
        )
        batches = gw.metrics.registry.get_sample_value("hkgw_batch_size_count", {"pool": "gpu"}) or 1.0
        items = gw.metrics.registry.get_sample_value("hkgw_batch_size_sum", {"pool": "gpu"}) or 0.0
    return result, items / batches


def null_repository(root: Path, specs: dict[str, ModelSpec]) -> None:
    """Config files for the null backend (``--backend null``): the GPU models' specs, no weights."""
    for spec in specs.values():
        (root / spec.name / "1").mkdir(parents=True, exist_ok=True)
        config = config_from_spec(spec, backend="onnxruntime")
        (root / spec.name / "config.pbtxt").write_text(text_format.MessageToString(config))
        (root / spec.name / "1" / "model.onnx").write_bytes(b"")


def null_specs() -> dict[str, ModelSpec]:
    from inference.backends.base import TensorSpec

    return {
        "bert-base": ModelSpec(
            "bert-base",
            "1",
            (TensorSpec("input_ids", "int64", (128,)), TensorSpec("attention_mask", "int64", (128,))),
            (TensorSpec("embedding", "float32", (768,)),),
            128,
            "tensor",
        ),
        "resnet50": ModelSpec(
            "resnet50",
            "1",
            (TensorSpec("pixels", "float16", (3, 224, 224)),),
            (TensorSpec("logits", "float32", (1000,)),),
            128,
            "tensor",
        ),
    }


async def main_async(args: argparse.Namespace) -> list[Point]:
    batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    models_dir = args.out / "models"
    points: list[Point] = []
    if args.backend == "torch":
        from gateway.backends.torch import TorchBackend, TorchOptions

        direct_backend = TorchBackend(
            "direct", TorchOptions(models=MODELS, device=args.device, dtype="float16", threads=1)
        )
        await direct_backend.start()
        specs = {m.name: m for m in direct_backend.models()}
    else:
        specs = null_specs()
        null_repository(models_dir, specs)
    # One driver process for the whole run (spawned: no CUDA or gateway state inherited).
    drivers = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        for model, factory in MODELS.items():
            spec = specs[model]
            if args.backend == "torch":
                call = _direct_call(direct_backend.loaded(model), args.device)
                backend = {
                    "type": "torch",
                    "models": {model: factory},
                    "device": args.device,
                    "dtype": "float16",
                }
            else:
                call = _no_model
                backend = {"type": "null", "repository": str(models_dir)}
            for batch in batches:
                direct = direct_rate(call, spec, batch, args.seconds)
                result, mean_batch = await gateway_point(
                    model, spec, backend, batch, args.seconds, models_dir, drivers
                )
                point = Point(
                    model=model,
                    batch=batch,
                    direct_items_per_s=direct,
                    gateway_items_per_s=result["items_per_s"],
                    gateway_ok=result["ok"],
                    gateway_late_or_failed=result["failed"],
                    gateway_p50_ms=result["p50_ms"],
                    gateway_p99_ms=result["p99_ms"],
                    gateway_mean_batch=mean_batch,
                )
                points.append(point)
                print(json.dumps(asdict(point)), flush=True)
    finally:
        drivers.shutdown()
        if args.backend == "torch":
            await direct_backend.aclose()
    return points


def _no_model(feed: dict[str, np.ndarray]) -> Any:
    """The harness check's "direct" call: no model at all."""
    return feed


def _direct_call(built: Any, device: str) -> Callable[[dict[str, np.ndarray]], Any]:
    torch = importlib.import_module("torch")

    def call(feed: dict[str, np.ndarray]) -> Any:
        with torch.inference_mode():
            tensors = {}
            for name, array in feed.items():
                t = torch.from_numpy(array).to(device, non_blocking=True)
                tensors[name] = t.half() if t.is_floating_point() else t
            return {k: v.float().cpu().numpy() for k, v in built.module(**tensors).items()}

    return call


def report(points: list[Point], args: argparse.Namespace) -> str:
    best: dict[str, float] = {}  # direct items/s at each model's largest batch size
    for p in sorted(points, key=lambda q: q.batch):
        best[p.model] = p.direct_items_per_s
    rows = [
        [
            p.model,
            str(p.batch),
            f"{p.direct_items_per_s:,.0f}",
            f"{p.gateway_items_per_s:,.0f}",
            f"{p.gateway_items_per_s / best[p.model]:.2f}",
            f"{p.gateway_mean_batch:.1f}",
            f"{p.gateway_p50_ms:.1f} / {p.gateway_p99_ms:.1f}",
            str(p.gateway_late_or_failed),
        ]
        for p in points
    ]
    header = ["model", "batch", "direct items/s", "gateway items/s", "gateway / direct b-max", "mean batch",
              "p50 / p99 ms", "late or failed"]  # fmt: skip
    day = datetime.date.today().isoformat()
    return (
        f"## GPU tier (issue 6)\n\nMeasured {day} on {machine()}, backend `{args.backend}` "
        f"(fp16, {args.device}), {args.seconds:.0f} s per point, deadline {DEADLINE_S * 1e3:.0f} ms.\n"
        f"Reproduce: `python3 -m bench.gpu_tier --out DIR --write` on the GPU machine.\n\n"
        + table(header, rows)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--backend", choices=["torch", "null"], default="torch")
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args()
    points = run_main(main_async(args))  # the gateway under test runs on uvloop, as hk-gateway does
    body = report(points, args)
    (args.out / "gpu_tier.json").write_text(json.dumps([asdict(p) for p in points], indent=1))
    (args.out / "gpu_tier.md").write_text(body + "\n")
    print(body)
    if args.write:
        update_section("gpu-tier", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
