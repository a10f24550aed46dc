"""The backend Protocol: what the dispatcher needs from an inference server, and nothing more.

A backend serves named, versioned models that take and return dense tensors. Turning wire requests into
tensors (and tensors back into wire outputs) is the pipeline's job (``inference.pipeline``), shared by every
backend, so that one input gives one output whichever pool serves it.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from routing.types import Priority

V = TypeVar("V")


class BackendHealth(enum.StrEnum):
    """Whether a backend can take traffic; the circuit breaker adds its own view on top."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output: name, numpy dtype name, dims without the batch dim (-1 = variable)."""

    name: str
    dtype: str
    dims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the gateway knows of a served model version (from Triton's ``config.pbtxt``)."""

    name: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    pipeline: str  # "ranking" | "text" | "image" | "tensor": how requests become tensors
    server_batching: bool = False  # the server batches dynamically: gateway-side batching is off
    parameters: Mapping[str, str] = field(default_factory=dict)

    def output(self, name: str) -> TensorSpec:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        raise KeyError(f"model {self.name} has no output {name}")


@dataclass(frozen=True, slots=True)
class ServedVersions(Generic[V]):
    """The model versions a backend serves at one moment, with its default version per model.

    Replaced whole, never changed in place: a call that found its entry keeps it while a reload swaps in
    the next set. ``V`` is what the backend keeps per version (a session, a remote model's spec, ...).
    """

    entries: Mapping[tuple[str, str], V]  # (model, version) -> the backend's entry
    defaults: Mapping[str, str]  # model -> the version an empty version means

    def find(self, model: str, version: str) -> V | None:
        """The entry of a version ("" = the model's default), or None."""
        chosen = self.defaults.get(model) if version == "" else version
        return None if chosen is None else self.entries.get((model, chosen))


@dataclass(frozen=True, slots=True)
class InferCall:
    """One batched call: a model, its dense inputs (batch dim first) and the call's constraints."""

    model: str
    version: str  # "" = the backend's default (latest) version
    inputs: Mapping[str, np.ndarray]
    priority: Priority
    timeout_s: float | None  # remaining deadline of the most urgent request in the batch


@dataclass(frozen=True, slots=True)
class InferResult:
    """Dense outputs (batch dim first) and the version that actually served."""

    outputs: Mapping[str, np.ndarray]
    model_version: str


class BackendError(Exception):
    """A failed call. ``retryable`` errors may be retried elsewhere; ``overloaded`` ones are shed, not failed.

    ``status`` is the wire Status name the requests are answered with when no retry is possible.
    """

    def __init__(
        self, message: str, *, retryable: bool, overloaded: bool = False, status: str = "INTERNAL"
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.overloaded = overloaded
        self.status = status


class ModelNotFound(BackendError):
    """The backend does not serve that model or version."""

    def __init__(self, model: str, version: str) -> None:
        super().__init__(
            f"model {model!r} version {version or 'latest'!r} not served",
            retryable=False,
            status="MODEL_NOT_FOUND",
        )


class Backend(Protocol):
    """An inference server behind a pool. ``aclose`` is safe before ``start`` and safe twice."""

    name: str

    async def start(self) -> None: ...

    async def infer(self, call: InferCall) -> InferResult: ...

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        """The spec of a served model version ("" = default), or None."""
        ...

    def health(self) -> BackendHealth: ...

    async def aclose(self) -> None: ...


def fits_one_call(call: InferCall, max_rows: int) -> bool:
    """Whether :func:`infer_within` sends ``call`` as it is: it has no more rows than ``max_rows`` (the
    model's ``max_batch_size``; 0 = no limit)."""
    if max_rows <= 0 or not call.inputs:
        return True
    rows: int = next(iter(call.inputs.values())).shape[0]
    return rows <= max_rows


async def infer_within(backend: Backend, call: InferCall, max_rows: int) -> InferResult:
    """``backend.infer(call)``, or several calls in turn when the batch has more rows than the model takes.

    Requests can carry many rows each (ranking candidates), and a batch of requests may hold more rows than
    a model's ``max_batch_size`` (``max_rows``; 0 = no limit): the rows are cut into calls of at most that
    many and the outputs joined, so no valid request fails because of how it was batched. The pieces share
    the call's deadline: each gets the time left, and none starts once it has passed.
    """
    if fits_one_call(call, max_rows):
        return await backend.infer(call)
    rows = next(iter(call.inputs.values())).shape[0]
    deadline = None if call.timeout_s is None else time.monotonic() + call.timeout_s
    parts = []
    for start in range(0, rows, max_rows):
        chunk = {name: array[start : start + max_rows] for name, array in call.inputs.items()}
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise BackendError(
                f"deadline passed after {start} of {rows} rows", retryable=False, status="DEADLINE_EXCEEDED"
            )
        parts.append(await backend.infer(dataclasses.replace(call, inputs=chunk, timeout_s=left)))
    outputs = {name: np.concatenate([p.outputs[name] for p in parts]) for name in parts[0].outputs}
    return InferResult(outputs=outputs, model_version=parts[0].model_version)


@runtime_checkable
class Rescanning(Protocol):
    """A backend that re-reads its model repository periodically (``onnx``): failed rescans are counted
    (the models already loaded stay served) and exported as ``hkgw_backend_rescan_failures_total``."""

    rescan_failures: int


@runtime_checkable
class HealthChecked(Protocol):
    """A backend that checks a remote server in the background (``triton``, ``rayserve``): failed checks
    are counted and exported as ``hkgw_backend_check_failures_total``."""

    refresh_failures: int


BackendFactory = Callable[[str, Mapping[str, Any]], Backend]
_REGISTRY: dict[str, BackendFactory] = {}


def register(type_name: str) -> Callable[[BackendFactory], BackendFactory]:
    """Register a backend factory under the config's ``type`` (e.g. ``onnx``, ``null``, ``triton``)."""

    def wrap(factory: BackendFactory) -> BackendFactory:
        if type_name in _REGISTRY:
            raise ValueError(f"backend type {type_name!r} registered twice")
        _REGISTRY[type_name] = factory
        return factory

    return wrap


def create(type_name: str, name: str, options: Mapping[str, Any]) -> Backend:
    """Build a backend from its config section; unknown types are a clear error."""
    try:
        factory = _REGISTRY[type_name]
    except KeyError:
        raise ValueError(f"unknown backend type {type_name!r}; known: {sorted(_REGISTRY)}") from None
    return factory(name, options)


def registered_types() -> list[str]:
    return sorted(_REGISTRY)
