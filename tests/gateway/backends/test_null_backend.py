"""The null (benchmark) backend: zeros of the declared output shapes, at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gateway.backends import builtin  # noqa: F401  (registers the built-in backend types)
from gateway.backends.null import NullBackend
from inference.backends.base import BackendHealth, InferCall, ModelNotFound, create
from inference.models import write_model_version
from routing.types import Priority
from tests.gateway.backends.serving import serve, synthetic


async def test_demo_models_answer_zeros_of_declared_shapes() -> None:
    """Without a repository, each demo model answers zeros shaped [batch, *dims]."""
    backend = NullBackend("bench")
    await backend.start()
    calls: dict[str, tuple[dict[str, np.ndarray], dict[str, tuple[int, ...]]]] = {
        "rank-mlp": (
            {"features": np.ones((7, 40), np.float32), "item_rows": np.ones((7, 1), np.int64)},
            {"scores": (7, 1)},
        ),
        "text-encoder": (
            {"input_ids": np.ones((3, 16), np.int64), "attention_mask": np.ones((3, 16), np.int64)},
            {"embedding": (3, 64)},
        ),
        "image-classifier": ({"pixels": np.ones((2, 3, 64, 64), np.float32)}, {"logits": (2, 10)}),
    }
    for model, (inputs, shapes) in calls.items():
        result = await backend.infer(InferCall(model, "", inputs, Priority.BATCH, None))
        assert {name: out.shape for name, out in result.outputs.items()} == shapes
        assert all(out.dtype == np.float32 and not out.any() for out in result.outputs.values())
        assert result.model_version == "1"
    await backend.aclose()


async def test_synthetic_requests_pass_through_pipelines() -> None:
    """Synthetic text requests run through the text pipeline against the null backend."""
    backend = NullBackend("bench")
    await backend.start()
    _, outputs, _ = await serve(backend, synthetic("text-encoder", 4))
    assert [list(t.shape) for (t,) in outputs] == [[64]] * 4
    await backend.aclose()


async def test_repository_models_are_served(tmp_path: Path) -> None:
    """With a repository, its models and their default versions are served."""
    write_model_version(tmp_path, "rank-mlp", 3, seed=1)
    backend = create("null", "bench", {"repository": str(tmp_path)})
    await backend.start()
    result = await backend.infer(
        InferCall(
            "rank-mlp",
            "",
            {"features": np.ones((5, 40), np.float32), "item_rows": np.ones((5, 1), np.int64)},
            Priority.BATCH,
            None,
        )
    )
    assert (result.outputs["scores"].shape, result.model_version) == ((5, 1), "3")
    assert backend.model("text-encoder") is None
    await backend.aclose()


async def test_unknown_model_is_model_not_found() -> None:
    """A model it does not list raises ModelNotFound."""
    backend = NullBackend("bench")
    await backend.start()
    with pytest.raises(ModelNotFound):
        await backend.infer(InferCall("resnet-50", "", {"x": np.ones((1, 2))}, Priority.BATCH, None))
    await backend.aclose()


async def test_lifecycle_is_safe_in_any_order() -> None:
    """aclose before start and twice is safe; health follows start and close."""
    backend = NullBackend("bench")
    await backend.aclose()
    await backend.aclose()
    assert backend.health() is BackendHealth.NOT_SERVING
    started = NullBackend("bench")
    await started.start()
    assert started.health() is BackendHealth.SERVING
    await started.aclose()
    assert started.health() is BackendHealth.NOT_SERVING


def test_factory_refuses_unknown_options() -> None:
    """The null backend's section takes only repository options."""
    with pytest.raises(ValueError, match="unknown option 'threads'"):
        create("null", "bench", {"threads": 2})


async def test_a_simulated_model_server_takes_its_time_per_call_and_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """simulated_call_s + simulated_row_s per row, waited on the loop (the waits recorded by a stand-in
    for asyncio.sleep that the test releases); two calls at once wait side by side."""
    waits: list[float] = []
    release = asyncio.Event()
    turn = asyncio.sleep  # the loop's own, for the test's turns: the stand-in replaces asyncio's

    async def held_sleep(seconds: float) -> None:
        waits.append(seconds)
        await release.wait()

    backend = create("null", "sim", {"simulated_call_s": 0.002, "simulated_row_s": 0.0005})
    await backend.start()
    monkeypatch.setattr(asyncio, "sleep", held_sleep)
    rows = {
        n: {"features": np.ones((n, 40), np.float32), "item_rows": np.ones((n, 1), np.int64)} for n in (4, 8)
    }
    calls = [
        asyncio.ensure_future(backend.infer(InferCall("rank-mlp", "", rows[n], Priority.BATCH, None)))
        for n in (4, 8)
    ]
    for _ in range(5):
        await turn(0)
    assert waits == [pytest.approx(0.004), pytest.approx(0.006)] and not any(c.done() for c in calls)
    release.set()
    results = await asyncio.gather(*calls)
    assert [r.outputs["scores"].shape for r in results] == [(4, 1), (8, 1)]
    await backend.aclose()
