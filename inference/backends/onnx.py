"""The embedded backend: ONNX Runtime on the gateway's own CPUs, serving a Triton-layout model repository.

Every loaded (model, version) has one ``InferenceSession``; calls run on a bounded thread pool so the event
loop never blocks on a model. New version directories are picked up without a restart, by a periodic
rescan or :meth:`OnnxBackend.reload`: the served set is swapped in one assignment, so new calls go to the
new default version while calls already under way finish on the session they started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import numpy as np
import structlog

from edgewire.extras import optional_dependency
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
from inference.backends.modelrepo import (
    ModelRepository,
    ModelRepositoryError,
    RepositoryChange,
    RepositoryOptions,
)
from inference.backends.options import backend_options, integer, seconds

# onnxruntime reads this once, at import: unset, it writes a device id and a telemetry database under
# ~/.cache/Microsoft and a session file in $TMPDIR of every host and test run ("0" keeps it on).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
with optional_dependency("agent-local", "gateway"):
    import onnxruntime as ort

_log = structlog.get_logger(__name__)

ONNX_BACKENDS: Final = frozenset({"onnxruntime", ""})
ONNX_PLATFORMS: Final = frozenset({"onnxruntime_onnx", ""})
_ORT_DTYPES: Final = {
    "tensor(bool)": "bool",
    "tensor(uint8)": "uint8",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
    "tensor(int8)": "int8",
    "tensor(int16)": "int16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(float16)": "float16",
    "tensor(float)": "float32",
    "tensor(double)": "float64",
    "tensor(string)": "object",
}
OnnxDevice = Literal["cpu", "cuda"]
DEVICES: Final = get_args(OnnxDevice)


@backend_options("onnx")
class OnnxOptions(RepositoryOptions):
    """The ``onnx`` backend's options (config keys of the same names)."""

    repository: Path  # required here: the embedded backend serves only what is on disk
    threads: Annotated[int, integer()] = 2  # calls run at once: the size of the thread pool
    intra_op_threads: Annotated[int, integer()] = 1  # ONNX Runtime threads inside one call
    rescan_interval_s: Annotated[float, seconds(zero_allowed=True)] = 5.0  # 0 = only on reload()
    # "cuda": ONNX Runtime's CUDA provider first (onnxruntime-gpu), the CPU for the rest
    device: OnnxDevice = "cpu"


@dataclass(frozen=True, slots=True)
class _Loaded:
    spec: ModelSpec
    session: Any  # onnxruntime.InferenceSession; onnxruntime ships no type information
    output_names: tuple[str, ...]


class OnnxBackend:
    """ONNX Runtime on CPU, on a thread pool of ``threads`` workers, serving a model repository.

    ``clock`` measures call deadlines (``InferCall.timeout_s``); tests pass their own.
    """

    def __init__(
        self, name: str, options: OnnxOptions, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self.options = options
        self._clock = clock
        self._repository = ModelRepository(
            options.repository, pins=options.pins, max_models=options.max_models
        )
        self._served: ServedVersions[_Loaded] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._rescan_task: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._closed = False
        self.rescan_failures = 0
        """Periodic rescans that failed (the previous models stay served); each is also logged."""

    @property
    def thread_name_prefix(self) -> str:
        """The name prefix of this backend's worker threads."""
        return f"onnx-{self.name}"

    async def start(self) -> None:
        """Scan the repository and load every served version; raises ModelRepositoryError on a bad one."""
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        if self._served is not None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.options.threads, thread_name_prefix=self.thread_name_prefix
            )
        async with self._reload_lock:
            _, self._served = await asyncio.to_thread(self._rescan, None)
        if self.options.rescan_interval_s > 0:
            self._rescan_task = asyncio.create_task(self._rescan_periodically(), name=f"{self.name}-rescan")

    async def reload(self) -> RepositoryChange:
        """Rescan now: load new versions, drop removed ones; calls under way finish where they started."""
        if self._served is None or self._closed:
            raise RuntimeError(f"backend {self.name!r} is not started")
        async with self._reload_lock:
            change, served = await asyncio.to_thread(self._rescan, self._served)
            if not self._closed:
                self._served = served
        return change

    async def infer(self, call: InferCall) -> InferResult:
        """Run one batch; the deadline is checked again when a worker thread picks the call up."""
        served, executor = self._served, self._executor
        if served is None or executor is None or self._closed:
            raise BackendError(f"backend {self.name!r} is not serving", retryable=True, status="UNAVAILABLE")
        deadline = None if call.timeout_s is None else self._clock() + call.timeout_s
        if call.timeout_s is not None and call.timeout_s <= 0:
            raise _deadline_exceeded(call)
        loaded = served.find(call.model, call.version)
        if loaded is None:
            raise ModelNotFound(call.model, call.version)
        feed = _checked_feed(loaded.spec, call.inputs)
        loop = asyncio.get_running_loop()
        outputs = await loop.run_in_executor(executor, self._run, loaded, feed, deadline, call)
        return InferResult(outputs=outputs, model_version=loaded.spec.version)

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        """The spec of a served model version ("" = the default), or None."""
        loaded = None if self._served is None else self._served.find(name, version)
        return None if loaded is None else loaded.spec

    def models(self) -> list[ModelSpec]:
        """Every served model version's spec."""
        return [] if self._served is None else [loaded.spec for loaded in self._served.entries.values()]

    def health(self) -> BackendHealth:
        """SERVING once started with at least one model, until closed."""
        if self._closed or self._served is None or not self._served.entries:
            return BackendHealth.NOT_SERVING
        return BackendHealth.SERVING

    async def aclose(self) -> None:
        """Stop rescanning, let calls under way finish, release the threads. Safe before start and twice."""
        if self._closed:
            return
        self._closed = True
        if self._rescan_task is not None:
            self._rescan_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._rescan_task
        if self._executor is not None:
            await asyncio.to_thread(self._executor.shutdown, wait=True)
        self._served = None

    def _run(
        self, loaded: _Loaded, feed: dict[str, np.ndarray], deadline: float | None, call: InferCall
    ) -> dict[str, np.ndarray]:
        if deadline is not None and self._clock() > deadline:
            raise _deadline_exceeded(call)
        try:
            results = loaded.session.run(list(loaded.output_names), feed)
        except Exception as exc:
            raise BackendError(
                f"model {loaded.spec.name} version {loaded.spec.version} failed: {exc}", retryable=False
            ) from exc
        return dict(zip(loaded.output_names, results, strict=True))

    def _rescan(
        self, current: ServedVersions[_Loaded] | None
    ) -> tuple[RepositoryChange, ServedVersions[_Loaded]]:
        """Runs on a worker thread: scan, load sessions for new versions, reuse the rest."""
        self._repository.scan()
        sessions: dict[tuple[str, str], _Loaded] = {}
        defaults: dict[str, str] = {}
        for name, entry in self._repository.models.items():
            defaults[name] = str(entry.default)
            for version in entry.loaded:
                key = (name, str(version))
                # Calls run as they come (no server batching): the gateway batches, whatever the config says.
                spec = dataclasses.replace(entry.spec(version), server_batching=False)
                previous = None if current is None else current.entries.get(key)
                if previous is not None and previous.spec == spec:
                    sessions[key] = previous
                else:
                    sessions[key] = self._load(entry.config, spec, entry.model_path(version))
        before = set() if current is None else set(current.entries)
        change = RepositoryChange(
            added=tuple(sorted(sessions.keys() - before)), removed=tuple(sorted(before - sessions.keys()))
        )
        return change, ServedVersions(sessions, defaults)

    def _load(self, config: Any, spec: ModelSpec, path: Path) -> _Loaded:
        config_path = path.parents[1] / "config.pbtxt"
        if config.backend not in ONNX_BACKENDS or config.platform not in ONNX_PLATFORMS:
            raise ModelRepositoryError(
                config_path, "backend", f"{config.backend or config.platform!r} is not an ONNX Runtime model"
            )
        if not config.backend and not config.platform:
            raise ModelRepositoryError(config_path, "backend", 'missing; set backend: "onnxruntime"')
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.options.intra_op_threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            session = ort.InferenceSession(str(path), sess_options=so, providers=self._providers())
        except Exception as exc:
            raise ModelRepositoryError(path, "model", f"ONNX Runtime cannot load it: {exc}") from exc
        have = {i.name: _ORT_DTYPES.get(i.type, i.type) for i in session.get_inputs()}
        for i, want in enumerate(spec.inputs):
            if have.get(want.name) != want.dtype:
                raise ModelRepositoryError(
                    config_path,
                    f"input[{i}]",
                    f"{want.name} {want.dtype} not in the model's inputs {have} ({path})",
                )
        outputs = {o.name for o in session.get_outputs()}
        missing = [o.name for o in spec.outputs if o.name not in outputs]
        if missing:
            raise ModelRepositoryError(
                config_path, "output", f"{missing} not in the model's outputs ({path})"
            )
        return _Loaded(spec, session, tuple(o.name for o in spec.outputs))

    def _providers(self) -> list[str]:
        if self.options.device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ModelRepositoryError(
                    self.options.repository,
                    "device",
                    "cuda asked for, but this onnxruntime has no CUDA provider",
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    async def _rescan_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.rescan_interval_s)
            try:
                change = await self.reload()
            except (ModelRepositoryError, OSError) as exc:
                self.rescan_failures += 1
                _log.warning("model repository rescan failed", backend=self.name, error=str(exc))
                continue
            if change:
                _log.info(
                    "model repository changed",
                    backend=self.name,
                    added=[f"{m}/{v}" for m, v in change.added],
                    removed=[f"{m}/{v}" for m, v in change.removed],
                )


@register("onnx")
def create_onnx_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Factory for ``type = "onnx"``: an :class:`OnnxBackend` from its config section."""
    return OnnxBackend(name, OnnxOptions.from_mapping(name, options))


def _checked_feed(spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The call's inputs, checked against the spec: names, dtypes, dims and the batch size."""
    names = {t.name for t in spec.inputs}
    if set(inputs) != names:
        raise _invalid(spec, f"inputs {sorted(inputs)}, the model takes {sorted(names)}")
    batch: set[int] = set()
    offset = 1 if spec.max_batch_size > 0 else 0
    for want in spec.inputs:
        array = inputs[want.name]
        if array.dtype != np.dtype(want.dtype):
            raise _invalid(spec, f"input {want.name} is {array.dtype}, the model takes {want.dtype}")
        dims = array.shape[offset:]
        if array.ndim != len(want.dims) + offset or any(
            w not in (-1, d) for w, d in zip(want.dims, dims, strict=True)
        ):
            raise _invalid(
                spec, f"input {want.name} has shape {list(array.shape)}, dims are {list(want.dims)}"
            )
        if offset:
            batch.add(array.shape[0])
    if len(batch) > 1:
        raise _invalid(spec, f"inputs disagree on the batch size: {sorted(batch)}")
    if batch and max(batch) > spec.max_batch_size:
        raise _invalid(spec, f"batch of {max(batch)} over max_batch_size {spec.max_batch_size}")
    return dict(inputs)


def _invalid(spec: ModelSpec, detail: str) -> BackendError:
    return BackendError(f"model {spec.name}: {detail}", retryable=False, status="INVALID_ARGUMENT")


def _deadline_exceeded(call: InferCall) -> BackendError:
    return BackendError(
        f"model {call.model}: deadline of {call.timeout_s}s passed before the call ran",
        retryable=False,
        status="DEADLINE_EXCEEDED",
    )
