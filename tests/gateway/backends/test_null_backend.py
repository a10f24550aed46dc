"""The null (benchmark) backend: zeros of the declared output shapes, at once."""

from __future__ import annotations

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
