"""The ``torch`` backend: PyTorch modules on a GPU inside the gateway process (a GPU tier without a server).

Each model comes from a factory named in the config, e.g.
``models = {bert-base = "gateway.models.gpu:bert_base"}``: a function ``(device, dtype) -> TorchModel``
that builds the module (weights loaded, eval mode, on the device) and says its :class:`ModelSpec`. Calls
run on ``threads`` worker threads (one CUDA stream each): inputs go to the device once (pinned host
memory, non-blocking copy), floating inputs in the backend's ``dtype``; outputs come back as float32
numpy. PyTorch is imported at ``start``, so a gateway without this backend never needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
from pydantic import Field, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from edgewire.extras import optional_dependency
from inference.backends.base import (
    Backend,
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelNotFound,
    ModelSpec,
    register,
)
from inference.backends.options import INVALID_OPTION, BackendOptions, backend_options, integer

TorchDtype = Literal["float16", "bfloat16", "float32"]
DTYPES: Final = get_args(TorchDtype)


@dataclass(frozen=True, slots=True)
class TorchModel:
    """A built model: ``module(**inputs)`` returns a dict of output tensors named as in ``spec``."""

    spec: ModelSpec
    module: Callable[..., Mapping[str, Any]]  # an eval-mode module on the device, or a callable around one


TorchFactory = Callable[[str, str], TorchModel]


def _factory_reference() -> WrapValidator:
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        if isinstance(value, str) and ":" in value:
            return value
        raise PydanticCustomError(INVALID_OPTION, f"must be 'package.module:factory', got {value!r}")

    return WrapValidator(check)


def _device() -> WrapValidator:
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        if isinstance(value, str) and value.startswith(("cuda", "cpu")):
            return value
        raise PydanticCustomError(INVALID_OPTION, f"must be 'cuda', 'cuda:N' or 'cpu', got {value!r}")

    return WrapValidator(check)


@backend_options("torch")
class TorchOptions(BackendOptions):
    """The ``torch`` backend's options (config keys of the same names)."""

    models: Annotated[dict[str, Annotated[str, _factory_reference()]], Field(min_length=1)]  # name -> factory
    device: Annotated[str, _device()] = "cuda:0"
    dtype: TorchDtype = "float16"
    threads: Annotated[int, integer(maximum=16)] = 2


class TorchBackend:
    """PyTorch modules on one device; see the module docstring."""

    def __init__(
        self, name: str, options: TorchOptions, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.options = options
        self._clock = clock
        self._models: dict[str, TorchModel] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._torch: Any = None
        self._streams = threading.local()
        self._closed = False

    async def start(self) -> None:
        """Import torch, build every model on the device and run one warm-up call each."""
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        if self._models:
            return
        try:
            with optional_dependency("torch"):
                self._torch = importlib.import_module("torch")
        except ImportError as exc:
            raise RuntimeError(
                f"backend {self.name!r}: type 'torch' needs PyTorch installed ({exc})"
            ) from exc
        self._executor = ThreadPoolExecutor(self.options.threads, thread_name_prefix=f"torch-{self.name}")
        for model, target in self.options.models.items():
            built = await asyncio.to_thread(_build, target, self.options.device, self.options.dtype)
            if built.spec.name != model:
                raise ValueError(
                    f"backend {self.name!r}: factory {target} built {built.spec.name!r}, not {model!r}"
                )
            self._models[model] = built

    async def infer(self, call: InferCall) -> InferResult:
        """One batch on the device; the deadline is checked again when a worker thread takes the call."""
        executor = self._executor
        if executor is None or self._closed:
            raise BackendError(f"backend {self.name!r} is not serving", retryable=True, status="UNAVAILABLE")
        model = self._models.get(call.model)
        if model is None or call.version not in ("", model.spec.version):
            raise ModelNotFound(call.model, call.version)
        deadline = None if call.timeout_s is None else self._clock() + call.timeout_s
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(executor, self._run, model, call, deadline)
        return InferResult(outputs=outputs, model_version=model.spec.version)

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        found = self._models.get(name)
        return None if found is None or version not in ("", found.spec.version) else found.spec

    def models(self) -> list[ModelSpec]:
        return [m.spec for m in self._models.values()]

    def loaded(self, name: str) -> TorchModel:
        """The built model (benchmarks call it directly to compare with the gateway path)."""
        return self._models[name]

    def health(self) -> BackendHealth:
        return BackendHealth.SERVING if self._models and not self._closed else BackendHealth.NOT_SERVING

    async def aclose(self) -> None:
        """Let calls under way finish, release the threads and the models. Safe before start and twice."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._models.clear()

    def _run(self, model: TorchModel, call: InferCall, deadline: float | None) -> dict[str, np.ndarray]:
        if deadline is not None and self._clock() > deadline:
            raise BackendError(
                f"model {call.model}: deadline passed before the call ran",
                retryable=False,
                status="DEADLINE_EXCEEDED",
            )
        torch = self._torch
        device = torch.device(self.options.device)
        dtype = getattr(torch, self.options.dtype)
        stream = self._stream(torch, device)
        try:
            with torch.inference_mode(), _on_stream(torch, stream):
                feed = {}
                for name, array in call.inputs.items():
                    # A read-only input (a lone tensor request is a view of the frame it came in) is
                    # copied: torch tensors are writable, and from_numpy warns on such an array.
                    owned = array if array.flags.writeable else np.array(array)
                    tensor = torch.from_numpy(np.ascontiguousarray(owned))
                    if device.type == "cuda":
                        tensor = tensor.pin_memory().to(device, non_blocking=True)
                    feed[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
                answer = model.module(**feed)
                outputs = {out.name: answer[out.name].float().cpu().numpy() for out in model.spec.outputs}
        except Exception as exc:  # any torch failure is this call's error, not the pool's bug
            raise BackendError(f"model {call.model} failed on {device}: {exc}", retryable=False) from exc
        return outputs

    def _stream(self, torch: Any, device: Any) -> Any:
        if device.type != "cuda":
            return None
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(device=device)
        return stream


def _build(target: str, device: str, dtype: str) -> TorchModel:
    module_name, _, function = target.partition(":")
    factory = getattr(importlib.import_module(module_name), function)
    built = factory(device, dtype)
    if not isinstance(built, TorchModel):
        raise TypeError(f"{target} returned {type(built).__name__}, not a TorchModel")
    return built


@contextlib.contextmanager
def _on_stream(torch: Any, stream: Any) -> Iterator[None]:
    """Run on this thread's CUDA stream (calls on other threads overlap with it); no-op on CPU."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


@register("torch")
def create_torch_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Factory for ``type = "torch"``: a :class:`TorchBackend` from its config section."""
    return TorchBackend(name, TorchOptions.from_mapping(name, options))
