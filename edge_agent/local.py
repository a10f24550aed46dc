"""The edge-device tier: the agent answers the simplest requests itself, with a local ONNX model.

Same model repository format and the same CPU pipelines as the gateway's embedded backend, so a request
served here gets the output it would get in Hong Kong; nothing crosses the border.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from edgewire import pb
from inference.backends.base import BackendError, InferCall, infer_within
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.pipeline import worker
from routing.types import Priority


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
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        first = requests[0]
        spec = self._backend.model(first.model_name, first.model_version)
        if spec is None:
            return [self._status(r, pb.STATUS_MODEL_NOT_FOUND, "no local model") for r in requests]
        payloads = [r.SerializeToString() for r in requests]
        prepared = await loop.run_in_executor(self._cpu, worker.prepare_batch, spec.pipeline, spec, payloads)
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
                fragments = await loop.run_in_executor(
                    self._cpu, worker.finish_batch, spec.pipeline, prepared, result.outputs
                )
                total_us = int((time.perf_counter() - started) * 1e6)
                for i, fragment in zip(prepared.kept, fragments, strict=True):
                    response = pb.InferResponse.FromString(fragment)
                    response.request_id = requests[i].request_id
                    response.status = pb.STATUS_OK
                    response.model_name = first.model_name
                    response.model_version = result.model_version
                    response.timing.total_us = total_us
                    out[requests[i].request_id] = response
        for response in out.values():
            response.tier = pb.TIER_EDGE_DEVICE
            response.pool = "local"
        self.served += len(out)
        return [out[r.request_id] for r in requests]

    @staticmethod
    def _status(request: pb.InferRequest, status: pb.Status.ValueType, message: str) -> pb.InferResponse:
        return pb.InferResponse(
            request_id=request.request_id, status=status, error_message=message, model_name=request.model_name
        )

    async def aclose(self) -> None:
        await self._backend.aclose()
        self._cpu.shutdown(wait=False, cancel_futures=True)
