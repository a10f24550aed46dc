"""A Ray Serve application that serves a Triton-layout model repository in KServe v2 over Ray's gRPC proxy.

The gateway's ``rayserve`` backend speaks ``inference.GRPCInferenceService`` to Ray Serve's gRPC proxy
(``grpc_servicer_functions`` = :data:`SERVICER`, tritonclient's servicer behind a pickling alias); the proxy
calls the method of the same name on this deployment. ModelInfer requests are batched across callers with
``@serve.batch``: requests for the same model and shape are concatenated along the batch dim (up to the
model's ``max_batch_size``), run as one ONNX Runtime call and split again.

CPU by default; ``num_gpus`` > 0 puts each replica on a GPU with ONNX Runtime's CUDA provider (needs
onnxruntime-gpu on the Ray nodes). Models are read with the embedded backend's own repository code; the
module ships in the package, so a Ray node needs only ``pip install 'hk-edge-gateway[rayserve]'``.

Run it: ``serve deploy deploy/rayserve/serve_config.yaml`` (see that file), or from Python
``serve.run(build_app({"repository": "/var/lib/hk-gateway/models"}), name="hk-models")``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgewire.extras import optional_dependency
from inference.backends.base import BackendError, InferCall, ModelSpec
from inference.backends.modelrepo import config_from_spec
from inference.backends.onnx import OnnxBackend, OnnxOptions
from routing.types import Priority

with optional_dependency("rayserve"):
    from ray import serve
    from tritonclient.grpc import service_pb2 as kserve
    from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

SERVICER = "inference.rayserve_app.add_kserve_servicer"

# tritonclient's generated messages name their module "grpc_service_pb2", which is not importable, so Ray
# cannot pickle them between its proxy and the replicas. The alias makes pickling by reference work in
# every process that imports this module (the proxy does, through SERVICER; the replicas through the class).
sys.modules.setdefault("grpc_service_pb2", kserve)


def add_kserve_servicer(servicer: Any, server: Any) -> None:
    """Ray's ``grpc_servicer_functions`` entry: KServe v2's service, with the pickling alias in place."""
    with optional_dependency("rayserve"):
        from tritonclient.grpc import service_pb2_grpc

    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


_Feed = dict[str, np.ndarray]
_Key = tuple[str, str]  # (model, version)
_Outcome = Mapping[str, np.ndarray] | Exception  # a request's outputs, or why it failed


class ModelError(Exception):
    """A request this application refuses; Ray's proxy answers it with an error status."""


class KServeModels:
    """Every model of one repository, answering KServe v2 methods, batched with ``@serve.batch``."""

    def __init__(
        self,
        repository: str,
        *,
        max_batch_size: int = 32,
        batch_wait_timeout_s: float = 0.002,
        threads: int = 2,
        test_execute_delay_s: float = 0.0,
    ) -> None:
        import ray

        device = "cuda" if ray.get_gpu_ids() else "cpu"
        options = OnnxOptions.from_mapping(
            "rayserve",
            {"repository": repository, "threads": threads, "rescan_interval_s": 0, "device": device},
        )
        self._backend = OnnxBackend("rayserve", options)
        self._started = False
        self._batch_wait_us = int(batch_wait_timeout_s * 1e6)
        # A stand-in for a slow GPU in tests (the queue fills, backpressure shows); never set in production.
        self._delay_s = test_execute_delay_s
        # Batched per replica with the deployment's own sizes (Ray's decorator form fixes them per class).
        self._batched = serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_timeout_s)(
            self._infer_batch
        )

    async def _ensure_started(self) -> OnnxBackend:
        if not self._started:
            await self._backend.start()
            self._started = True
        return self._backend

    async def ServerLive(self, request: Any) -> Any:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any) -> Any:
        backend = await self._ensure_started()
        return kserve.ServerReadyResponse(ready=bool(backend.models()))

    async def ModelReady(self, request: Any) -> Any:
        backend = await self._ensure_started()
        return kserve.ModelReadyResponse(ready=backend.model(request.name, request.version) is not None)

    async def RepositoryIndex(self, request: Any) -> Any:
        backend = await self._ensure_started()
        answer = kserve.RepositoryIndexResponse()
        for spec in sorted(backend.models(), key=lambda s: (s.name, int(s.version))):
            answer.models.add(name=spec.name, version=spec.version, state="READY")
        return answer

    async def ModelConfig(self, request: Any) -> Any:
        backend = await self._ensure_started()
        spec = backend.model(request.name, request.version)
        if spec is None:
            raise ModelError(f"model {request.name!r} version {request.version or 'latest'!r} not served")
        return kserve.ModelConfigResponse(config=self._config(spec))

    async def ModelInfer(self, request: Any) -> Any:
        backend = await self._ensure_started()
        spec = backend.model(request.model_name, request.model_version)
        if spec is None:
            raise ModelError(f"model {request.model_name!r} version {request.model_version!r} not served")
        feed = _decode(request)
        outputs = await self._batched(((spec.name, spec.version), feed))
        if isinstance(outputs, Exception):
            raise outputs
        answer = kserve.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id)
        for name, array in outputs.items():
            answer.outputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
            answer.raw_output_contents.append(np.ascontiguousarray(array).tobytes())
        return answer

    async def _infer_batch(self, requests: list[tuple[_Key, _Feed]]) -> list[_Outcome]:
        """One Ray batch: concatenate what can run together, one backend call per group, split again."""
        feeds = [feed for _, feed in requests]
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        groups: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, (key, feed) in enumerate(requests):
            shapes = tuple(sorted((n, a.shape[1:], a.dtype.str) for n, a in feed.items()))
            groups[(key, shapes)].append(i)
        results: list[_Outcome] = [ModelError("not run")] * len(feeds)
        calls = []
        for (key, _), members in groups.items():
            spec = self._backend.model(*key)
            assert spec is not None  # checked in ModelInfer; versions are not unloaded (no rescans)
            for chunk in _chunks(members, [_rows(feeds[i]) for i in members], spec.max_batch_size):
                calls.append(self._run(spec, [feeds[i] for i in chunk], chunk, results))
        await asyncio.gather(*calls)
        return results

    async def _run(
        self,
        spec: ModelSpec,
        feeds: list[_Feed],
        members: list[int],
        results: list[_Outcome],
    ) -> None:
        joined = {name: np.concatenate([f[name] for f in feeds]) for name in feeds[0]}
        try:
            result = await self._backend.infer(
                InferCall(spec.name, spec.version, joined, Priority.INTERACTIVE, timeout_s=None)
            )
        except BackendError as exc:
            for i in members:
                results[i] = ModelError(str(exc))
            return
        bounds = np.cumsum([_rows(f) for f in feeds])[:-1]
        split = {name: np.split(array, bounds) for name, array in result.outputs.items()}
        for j, i in enumerate(members):
            results[i] = {name: parts[j] for name, parts in split.items()}

    def _config(self, spec: ModelSpec) -> Any:
        config = config_from_spec(spec, backend="rayserve")
        # This deployment batches (``@serve.batch``): say so, and the gateway sends requests one by one.
        config.dynamic_batching.max_queue_delay_microseconds = self._batch_wait_us
        return config


def _decode(request: Any) -> _Feed:
    if len(request.raw_input_contents) != len(request.inputs):
        raise ModelError("inputs must be sent as raw_input_contents, one per input")
    feed: _Feed = {}
    for tensor, raw in zip(request.inputs, request.raw_input_contents, strict=True):
        dtype = triton_to_np_dtype(tensor.datatype)
        if dtype is None or dtype is np.object_:
            raise ModelError(f"input {tensor.name}: datatype {tensor.datatype} not supported")
        shape = tuple(int(d) for d in tensor.shape)
        if int(np.prod(shape)) * np.dtype(dtype).itemsize != len(raw):
            raise ModelError(f"input {tensor.name}: {len(raw)} bytes do not hold shape {list(shape)}")
        feed[tensor.name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return feed


def _rows(feed: _Feed) -> int:
    return int(next(iter(feed.values())).shape[0])


def _chunks(members: list[int], rows: list[int], limit: int) -> list[list[int]]:
    chunks: list[list[int]] = [[]]
    total = 0
    for member, n in zip(members, rows, strict=True):
        if chunks[-1] and total + n > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(member)
        total += n
    return chunks


def build_app(args: Mapping[str, Any]) -> Any:
    """The application, from ``serve run`` args: repository, num_replicas, num_cpus, num_gpus, batching."""
    deployment = serve.deployment(
        name="KServeModels",
        num_replicas=int(args.get("num_replicas", 1)),
        ray_actor_options={
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
        },
        # max_ongoing_requests must cover a whole batch, or Ray's default (5) caps the batch size.
        max_ongoing_requests=int(args.get("max_ongoing_requests", 2 * int(args.get("max_batch_size", 32)))),
        max_queued_requests=int(args.get("max_queued_requests", 256)),
    )(KServeModels)
    return deployment.bind(
        str(args.get("repository", os.environ.get("HK_MODEL_REPOSITORY", "/var/lib/hk-gateway/models"))),
        max_batch_size=int(args.get("max_batch_size", 32)),
        batch_wait_timeout_s=float(args.get("batch_wait_timeout_s", 0.002)),
        threads=int(args.get("threads", 2)),
        test_execute_delay_s=float(args.get("test_execute_delay_s", 0.0)),
    )
