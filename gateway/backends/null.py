"""The null backend, for benchmarks: it serves model specs and answers every call with zeros.

It measures the gateway without any model cost: ingress, decode, routing, batching, pipelines and replies
all run as in production, and the backend call costs nothing. Never configure it for real traffic.

A GPU cannot run here, so a bench that needs a backend slower than the gateway (its pools' queues, not
the gateway's CPU, the bound) gives it a simulated device instead: ``simulated_call_s`` and
``simulated_row_s`` make each call take that long plus that much per row, waited without CPU, calls in
parallel as a model server runs as many as it has instances (the pool's ``concurrency`` bounds them):
a fake, named as such, of a model server's batch latency.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import numpy as np

from inference.backends.base import (
    Backend,
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelNotFound,
    ModelSpec,
    ServedVersions,
    register,
)
from inference.backends.modelrepo import ModelRepository, RepositoryOptions, spec_from_config
from inference.backends.options import backend_options, seconds
from inference.models.demo import DEMO_MODELS, demo_config


@backend_options("null")
class NullOptions(RepositoryOptions):
    """The ``null`` backend's options: where its model specs come from (none = the demo models), and a
    simulated device's time per call and per row (0: answered at once)."""

    simulated_call_s: Annotated[float, seconds(zero_allowed=True)] = 0.0
    simulated_row_s: Annotated[float, seconds(zero_allowed=True)] = 0.0


class NullBackend:
    """Benchmark backend: zeros of each declared output shape for every call, at once or after the
    simulated device's time.

    It serves the models of ``repository`` (their serving versions, read like the ONNX backend reads them)
    or, without one, version 1 of the three demo models. An output's batch dim is the first input's first
    dim; a variable (-1) output dim is answered as 1.
    """

    def __init__(
        self,
        name: str,
        *,
        repository: Path | None = None,
        pins: Mapping[str, str] | None = None,
        max_models: int = 64,
        simulated_call_s: float = 0.0,
        simulated_row_s: float = 0.0,
    ) -> None:
        self.name = name
        self._call_s, self._row_s = simulated_call_s, simulated_row_s
        self._repository = (
            None if repository is None else ModelRepository(repository, pins=pins, max_models=max_models)
        )
        self._specs: dict[tuple[str, str], ModelSpec] = {}
        self._defaults: dict[str, str] = {}
        self._served = ServedVersions(self._specs, self._defaults)  # views of the two dicts start() fills
        # Per served spec (by id: start() fills _specs once and keeps them), each output's name, shape
        # without the batch dim and dtype: worked out once, not on every call.
        self._outputs: dict[int, tuple[tuple[str, tuple[int, ...], np.dtype[Any]], ...]] = {}
        self._started = False
        self._closed = False

    async def start(self) -> None:
        """Read the repository (or the built-in demo specs)."""
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        if self._repository is None:
            for model in DEMO_MODELS:
                config = demo_config(model)
                self._specs[(model, "1")] = spec_from_config(config, "1", Path(model) / "config.pbtxt")
                self._defaults[model] = "1"
        else:
            entries = await asyncio.to_thread(self._repository.scan)
            for name, entry in entries.items():
                self._defaults[name] = str(entry.default)
                for version in entry.loaded:
                    spec = dataclasses.replace(entry.spec(version), server_batching=False)
                    self._specs[(name, str(version))] = spec
        for spec in self._specs.values():
            self._outputs[id(spec)] = tuple(
                (out.name, tuple(max(d, 1) for d in out.dims), np.dtype(out.dtype)) for out in spec.outputs
            )
        self._started = True

    async def infer(self, call: InferCall) -> InferResult:
        """Zeros of every output's declared shape; the batch dim follows the first input."""
        if not self._started or self._closed:
            raise BackendError(f"backend {self.name!r} is not serving", retryable=True, status="UNAVAILABLE")
        spec = self.model(call.model, call.version)
        if spec is None:
            raise ModelNotFound(call.model, call.version)
        first = call.inputs.get(spec.inputs[0].name)
        if first is None:
            first = next(iter(call.inputs.values()), np.zeros(0))
        lead: tuple[int, ...] = (first.shape[0] if first.ndim else 0,) if spec.max_batch_size > 0 else ()
        outputs = {name: np.zeros(lead + dims, dtype=dtype) for name, dims, dtype in self._outputs[id(spec)]}
        if self._call_s or self._row_s:
            await asyncio.sleep(self._call_s + self._row_s * (lead[0] if lead else 1))
        return InferResult(outputs=outputs, model_version=spec.version)

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        """The spec of a served model version ("" = the default), or None."""
        return self._served.find(name, version)

    def models(self) -> list[ModelSpec]:
        """Every served model version's spec."""
        return list(self._specs.values())

    def health(self) -> BackendHealth:
        """SERVING once started, until closed."""
        return BackendHealth.SERVING if self._started and not self._closed else BackendHealth.NOT_SERVING

    async def aclose(self) -> None:
        """Stop serving. Safe before start and twice."""
        self._closed = True


@register("null")
def create_null_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Factory for ``type = "null"`` (benchmarks only): a :class:`NullBackend` from its config section."""
    repo = NullOptions.from_mapping(name, options)
    return NullBackend(
        name,
        repository=repo.repository,
        pins=repo.pins,
        max_models=repo.max_models,
        simulated_call_s=repo.simulated_call_s,
        simulated_row_s=repo.simulated_row_s,
    )
