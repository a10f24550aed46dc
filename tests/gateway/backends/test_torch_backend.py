"""The torch backend: its config, calls on the CPU with a tiny model, and its failure without PyTorch.

The GPU path (pinned host memory, one CUDA stream per thread) runs in bench/gpu_tier.py on a GPU machine;
here the same ``infer`` runs on the CPU build of PyTorch that the test setup installs.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np
import pytest

from gateway.backends.torch import TorchBackend, TorchModel, TorchOptions
from inference.backends.base import (
    BackendError,
    BackendHealth,
    InferCall,
    ModelNotFound,
    ModelSpec,
    TensorSpec,
    create,
)
from routing.types import Priority

HERE = __name__
WEIGHTS = np.arange(8, dtype=np.float32).reshape(2, 4) / 8  # scores = features @ WEIGHTS.T + offsets
SEEN_DTYPES: list[dict[str, str]] = []  # the dtypes tiny_scorer's module was given, call by call


def tiny_scorer(device: str, dtype: str) -> TorchModel:
    """A two-output linear scorer on ``device`` in ``dtype``: ``features`` [4] float, ``offsets`` [1] int."""
    import torch

    linear = torch.nn.Linear(4, 2, bias=False).eval()
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(WEIGHTS))
    linear = linear.to(device, getattr(torch, dtype))

    def score(features: Any, offsets: Any) -> dict[str, Any]:
        SEEN_DTYPES.append({"features": str(features.dtype), "offsets": str(offsets.dtype)})
        return {"scores": linear(features) + offsets.to(features.dtype)}

    spec = ModelSpec(
        name="tiny-scorer",
        version="3",
        inputs=(TensorSpec("features", "float32", (4,)), TensorSpec("offsets", "int64", (1,))),
        outputs=(TensorSpec("scores", "float32", (2,)),),
        max_batch_size=8,
        pipeline="tensor",
    )
    return TorchModel(spec, score)


def broken(device: str, dtype: str) -> TorchModel:
    """A model whose every call fails inside PyTorch (a shape mismatch)."""
    import torch

    def fail(features: Any, offsets: Any) -> dict[str, Any]:
        return {"scores": features @ torch.ones(3, 3, dtype=features.dtype)}

    return TorchModel(tiny_scorer(device, dtype).spec, fail)


def cpu_backend(dtype: str = "float32", factory: str = "tiny_scorer", **kwargs: Any) -> TorchBackend:
    options = TorchOptions.from_mapping(
        "cpu-torch", {"models": {"tiny-scorer": f"{HERE}:{factory}"}, "device": "cpu", "dtype": dtype}
    )
    return TorchBackend("cpu-torch", options, **kwargs)


def scorer_call(rows: int = 3, version: str = "", timeout_s: float | None = 5.0) -> InferCall:
    features = np.linspace(-1.0, 1.0, rows * 4, dtype=np.float32).reshape(rows, 4)
    offsets = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    return InferCall(
        "tiny-scorer", version, {"features": features, "offsets": offsets}, Priority.REALTIME, timeout_s
    )


@pytest.fixture
def no_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch made unimportable for one test (None in sys.modules fails ``import torch``)."""
    monkeypatch.setitem(sys.modules, "torch", None)


def test_pytorch_is_installed_for_the_tests() -> None:
    """The test setup installs PyTorch's CPU build, so the calls below run instead of being skipped."""
    import importlib.util

    assert importlib.util.find_spec("torch") is not None, "scripts/setup.sh installs PyTorch (CPU)"


def test_options_are_read_with_defaults() -> None:
    """Models map names to factories; fp16 on cuda:0 with two threads unless told otherwise."""
    options = TorchOptions.from_mapping("gpu", {"models": {"bert-base": "gateway.models.gpu:bert_base"}})
    assert (options.device, options.dtype, options.threads) == ("cuda:0", "float16", 2)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "models"),
        ({"models": {"m": "no_colon"}}, "models"),
        ({"models": {"m": "a:b"}, "dtype": "int8"}, "dtype"),
        ({"models": {"m": "a:b"}, "device": "tpu"}, "device"),
        ({"models": {"m": "a:b"}, "threads": 0}, "threads"),
        ({"models": {"m": "a:b"}, "gpus": 2}, "gpus"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        create("torch", "gpu", options)


async def test_a_call_runs_the_model_on_the_cpu() -> None:
    """A batch goes through the module and comes back as float32 numpy, answered by the model's version."""
    backend = cpu_backend()
    await backend.start()
    try:
        call = scorer_call()
        result = await backend.infer(call)
        health = backend.health()
    finally:
        await backend.aclose()
    expected = call.inputs["features"] @ WEIGHTS.T + call.inputs["offsets"]
    assert health is BackendHealth.SERVING
    assert result.model_version == "3"
    assert result.outputs["scores"].dtype == np.float32
    np.testing.assert_allclose(result.outputs["scores"], expected, rtol=1e-6, atol=1e-6)
    assert backend.health() is BackendHealth.NOT_SERVING


async def test_read_only_inputs_are_served_without_a_warning() -> None:
    """A lone tensor request reaches the backend as a read-only view of its frame: it is served like a
    writable array, and torch's warning about non-writable arrays is not raised (it is copied first)."""
    backend = cpu_backend()
    await backend.start()
    try:
        call = scorer_call()
        for array in call.inputs.values():
            array.flags.writeable = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            result = await backend.infer(call)
    finally:
        await backend.aclose()
    expected = call.inputs["features"] @ WEIGHTS.T + call.inputs["offsets"]
    np.testing.assert_allclose(result.outputs["scores"], expected, rtol=1e-6, atol=1e-6)


async def test_floating_inputs_take_the_backends_dtype_and_integers_stay() -> None:
    """In bfloat16, float inputs reach the module as bfloat16, int64 ones unchanged; outputs are float32."""
    backend = cpu_backend("bfloat16")
    await backend.start()
    try:
        SEEN_DTYPES.clear()
        call = scorer_call()
        result = await backend.infer(call)
    finally:
        await backend.aclose()
    assert SEEN_DTYPES == [{"features": "torch.bfloat16", "offsets": "torch.int64"}]
    expected = call.inputs["features"] @ WEIGHTS.T + call.inputs["offsets"]
    assert result.outputs["scores"].dtype == np.float32
    np.testing.assert_allclose(result.outputs["scores"], expected, atol=0.05)


async def test_unknown_model_or_version_is_model_not_found() -> None:
    """A model or version the backend does not serve raises ModelNotFound, not a torch error."""
    backend = cpu_backend()
    await backend.start()
    try:
        with pytest.raises(ModelNotFound):
            await backend.infer(scorer_call(version="7"))
        with pytest.raises(ModelNotFound):
            await backend.infer(InferCall("bert-base", "", {}, Priority.REALTIME, 1.0))
    finally:
        await backend.aclose()


async def test_a_deadline_passed_when_a_thread_takes_the_call_is_deadline_exceeded() -> None:
    """The deadline is checked again on the worker thread: passed by then, the model is not run."""
    readings = iter([100.0, 100.0 + 0.5 + 0.001])  # infer reads the clock, then the worker thread does
    backend = cpu_backend(clock=lambda: next(readings))
    await backend.start()
    try:
        SEEN_DTYPES.clear()
        with pytest.raises(BackendError) as caught:
            await backend.infer(scorer_call(timeout_s=0.5))
    finally:
        await backend.aclose()
    assert (caught.value.status, caught.value.retryable) == ("DEADLINE_EXCEEDED", False)
    assert SEEN_DTYPES == []


async def test_a_failing_model_is_that_calls_error() -> None:
    """An exception inside PyTorch fails the call as a non-retryable BackendError; the backend serves on."""
    backend = cpu_backend(factory="broken")
    await backend.start()
    try:
        with pytest.raises(BackendError, match="model tiny-scorer failed on cpu") as caught:
            await backend.infer(scorer_call())
        health = backend.health()
    finally:
        await backend.aclose()
    assert (caught.value.status, caught.value.retryable) == ("INTERNAL", False)
    assert health is BackendHealth.SERVING


async def test_a_factory_that_builds_another_model_fails_the_start() -> None:
    """A factory whose model is named differently from its config key fails the start, naming both."""
    options = TorchOptions.from_mapping(
        "cpu-torch", {"models": {"scorer": f"{HERE}:tiny_scorer"}, "device": "cpu"}
    )
    backend = TorchBackend("cpu-torch", options)
    with pytest.raises(ValueError, match="built 'tiny-scorer', not 'scorer'"):
        await backend.start()
    await backend.aclose()


async def test_calls_before_start_and_after_close_are_unavailable() -> None:
    """Not started or closed, a call is refused as UNAVAILABLE (retryable elsewhere)."""
    backend = cpu_backend()
    with pytest.raises(BackendError) as before:
        await backend.infer(scorer_call())
    await backend.start()
    await backend.aclose()
    with pytest.raises(BackendError) as after:
        await backend.infer(scorer_call())
    for caught in (before, after):
        assert (caught.value.status, caught.value.retryable) == ("UNAVAILABLE", True)


@pytest.mark.usefixtures("no_pytorch")
async def test_start_without_pytorch_is_a_clear_error() -> None:
    """A gateway configured with a torch backend on a host without PyTorch fails to start, saying why."""
    backend = TorchBackend("gpu", TorchOptions.from_mapping("gpu", {"models": {"m": "a:b"}}))
    with pytest.raises(RuntimeError, match="needs PyTorch"):
        await backend.start()
    assert backend.health() is BackendHealth.NOT_SERVING
    await backend.aclose()
    await backend.aclose()
