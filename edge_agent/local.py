"""The edge-device tier: the agent answers the simplest requests itself, with a local ONNX model.

Same model repository format and the same CPU pipelines as the gateway's embedded backend, so a request
served here gets the output it would get in Hong Kong; nothing crosses the border.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np

from edgewire import pb
from inference.backends.base import BackendError, InferCall, infer_within
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.pipeline import worker
from inference.pipeline.base import Prepared
from inference.pipeline.registry import CHEAP_PIPELINES, LOOP_PIPELINES, pipeline_for
from routing.types import Priority

T = TypeVar("T")


ON_LOOP_PIPELINES: Final = CHEAP_PIPELINES - LOOP_PIPELINES
"""Pipelines whose small batches are prepared and finished on the event loop: tens of microseconds per
request, less than the two thread hand-offs a batch would otherwise cost (images take milliseconds and
tensor requests may carry BYTES tensors decoded one by one: those go to the CPU thread)."""
ON_LOOP_MAX_BYTES: Final = 64 << 10
"""A batch of more request bytes than this is prepared on the CPU thread whatever its pipeline."""


def _on_loop(pipeline: str, requests: Sequence[pb.InferRequest]) -> bool:
    return pipeline in ON_LOOP_PIPELINES and sum(r.ByteSize() for r in requests) <= ON_LOOP_MAX_BYTES


def _finish(pipeline: str, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
    """Per kept request, its output tensors (the messages themselves: nothing to serialize and parse)."""
    return pipeline_for(pipeline).finish(prepared, outputs)


class LocalTier:
    """Serves requests on this node. ``serves(model)`` says whether a local model exists."""

    def __init__(self, repository: Path, threads: int = 1) -> None:
        self._backend = OnnxBackend(
            "local",
            OnnxOptions.from_mapping(
                "local", {"repository": str(repository), "threads": threads, "rescan_interval_s": 0}
            ),
        )
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-cpu")
        self.served = 0

    async def start(self) -> None:
        await self._backend.start()

    def serves(self, model: str, version: str = "") -> bool:
        return self._backend.model(model, version) is not None

    async def serve(self, requests: Sequence[pb.InferRequest]) -> list[pb.InferResponse]:
        """Answer a batch of one model's requests locally; every request gets a response."""
        started = time.perf_counter()
        first = requests[0]
        spec = self._backend.model(first.model_name, first.model_version)
        if spec is None:
            return [self._status(r, pb.STATUS_MODEL_NOT_FOUND, "no local model") for r in requests]
        on_loop = _on_loop(spec.pipeline, requests)
        prepared = await self._cpu_step(on_loop, worker.prepare_requests, spec.pipeline, spec, requests)
        out: dict[bytes, pb.InferResponse] = {}
        for index, (label, detail) in prepared.rejected.items():
            out[requests[index].request_id] = self._status(
                requests[index], pb.STATUS_INVALID_ARGUMENT, f"{label}: {detail}"
            )
        if prepared.kept:
            try:
                call = InferCall(
                    first.model_name, first.model_version, prepared.inputs, Priority.REALTIME, None
                )
                result = await infer_within(self._backend, call, spec.max_batch_size)
            except BackendError as exc:
                for i in prepared.kept:
                    out[requests[i].request_id] = self._status(requests[i], pb.STATUS_INTERNAL, str(exc))
            else:
                outputs = await self._cpu_step(on_loop, _finish, spec.pipeline, prepared, result.outputs)
                total_us = int((time.perf_counter() - started) * 1e6)
                for i, tensors in zip(prepared.kept, outputs, strict=True):
                    response = pb.InferResponse(
                        request_id=requests[i].request_id,
                        status=pb.STATUS_OK,
                        model_name=first.model_name,
                        model_version=result.model_version,
                        outputs=tensors,
                    )
                    response.timing.total_us = total_us
                    out[requests[i].request_id] = response
        for response in out.values():
            response.tier = pb.TIER_EDGE_DEVICE
            response.pool = "local"
        self.served += len(out)
        return [out[r.request_id] for r in requests]

    async def _cpu_step(self, on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` here, on the event loop, or on the tier's CPU thread."""
        if on_loop:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    @staticmethod
    def _status(request: pb.InferRequest, status: pb.Status.ValueType, message: str) -> pb.InferResponse:
        return pb.InferResponse(
            request_id=request.request_id, status=status, error_message=message, model_name=request.model_name
        )

    async def aclose(self) -> None:
        await self._backend.aclose()
        self._cpu.shutdown(wait=False, cancel_futures=True)
