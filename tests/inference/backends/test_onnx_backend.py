"""The embedded ONNX Runtime backend on the demo repository: serving, versions, deadlines, lifecycle."""

from __future__ import annotations

import asyncio
import itertools
import threading
from pathlib import Path

import numpy as np
import pytest

from gateway.backends import builtin  # noqa: F401  (registers the built-in backend types)
from gateway.testing import wait_for
from inference.backends.base import (
    BackendError,
    BackendHealth,
    InferCall,
    ModelNotFound,
    create,
    registered_types,
)
from inference.backends.modelrepo import ModelRepositoryError
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.models import write_model_version
from routing.types import Priority
from tests.gateway.backends.serving import serve, synthetic


def options(repository: Path, **overrides: object) -> OnnxOptions:
    """Backend options on a repository, periodic rescans off unless overridden."""
    settings: dict[str, object] = {"repository": str(repository), "rescan_interval_s": 0, **overrides}
    return OnnxOptions.from_mapping("cpu", settings)


def ranking_call(version: str = "", timeout_s: float | None = 5.0, rows: int = 3) -> InferCall:
    """A rank-mlp call on fixed features."""
    features = np.linspace(-1.0, 1.0, rows * 40, dtype=np.float32).reshape(rows, 40)
    items = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    return InferCall(
        "rank-mlp", version, {"features": features, "item_rows": items}, Priority.REALTIME, timeout_s
    )


async def test_ranking_requests_get_top_k_items(backend: OnnxBackend) -> None:
    """Synthetic ranking requests come back as top_k item ids with descending scores."""
    requests = synthetic("rank-mlp", 6)
    prepared, outputs, result = await serve(backend, requests)
    assert prepared.kept == list(range(6))
    assert result.model_version == "1"
    for request, (item_ids, scores) in zip(requests, outputs, strict=True):
        k = min(request.ranking.top_k, len(request.ranking.candidate_item_ids))
        assert (item_ids.name, list(item_ids.shape)) == ("item_ids", [k])
        assert (scores.name, list(scores.shape)) == ("scores", [k])
        values = np.frombuffer(scores.raw_data, dtype="<f4")
        assert np.all(np.diff(values) <= 0)
        assert set(np.frombuffer(item_ids.raw_data, dtype="<u8")) <= set(request.ranking.candidate_item_ids)


async def test_text_requests_get_unit_embeddings(backend: OnnxBackend) -> None:
    """Synthetic text requests come back as one L2-normalised 64-wide embedding each."""
    requests = synthetic("text-encoder", 8)
    _, outputs, _ = await serve(backend, requests)
    assert len(outputs) == 8
    for (embedding,) in outputs:
        assert (embedding.name, list(embedding.shape)) == ("embedding", [64])
        assert np.linalg.norm(np.frombuffer(embedding.raw_data, dtype="<f4")) == pytest.approx(1.0, abs=1e-5)


async def test_image_requests_get_probabilities_and_label(backend: OnnxBackend) -> None:
    """Synthetic JPEG uploads come back as 10 class probabilities and one label."""
    requests = synthetic("image-classifier", 4)
    _, outputs, _ = await serve(backend, requests)
    assert len(outputs) == 4
    for probs, label in outputs:
        assert (probs.name, list(probs.shape)) == ("probs", [10])
        assert np.frombuffer(probs.raw_data, dtype="<f4").sum() == pytest.approx(1.0, abs=1e-5)
        assert (label.name, list(label.shape)) == ("label", [1])


async def test_latest_version_is_served_by_default(repository: Path) -> None:
    """With versions 1 and 2 on disk, an empty version is served by 2."""
    write_model_version(repository, "rank-mlp", 2, seed=2)
    backend = OnnxBackend("cpu", options(repository))
    await backend.start()
    try:
        assert (await backend.infer(ranking_call())).model_version == "2"
    finally:
        await backend.aclose()


async def test_pinned_version_is_served_by_default(repository: Path) -> None:
    """A pin keeps the default on version 1 although 2 is on disk; 2 stays reachable by name."""
    write_model_version(repository, "rank-mlp", 2, seed=2)
    backend = OnnxBackend("cpu", options(repository, pins={"rank-mlp": "1"}))
    await backend.start()
    try:
        assert (await backend.infer(ranking_call())).model_version == "1"
        assert (await backend.infer(ranking_call("2"))).model_version == "2"
    finally:
        await backend.aclose()


async def test_new_version_is_served_after_reload(backend: OnnxBackend, repository: Path) -> None:
    """A version 2 directory written at run time serves new calls after reload, with other scores."""
    before = await backend.infer(ranking_call())
    write_model_version(repository, "rank-mlp", 2, seed=2)
    change = await backend.reload()
    after = await backend.infer(ranking_call())
    assert change.added == (("rank-mlp", "2"),)
    assert (before.model_version, after.model_version) == ("1", "2")
    assert not np.allclose(before.outputs["scores"], after.outputs["scores"])


async def test_call_under_way_finishes_on_its_version(backend: OnnxBackend, repository: Path) -> None:
    """A call that started before a reload is answered by the version it started on."""
    write_model_version(repository, "rank-mlp", 2, seed=2)
    in_flight = asyncio.create_task(backend.infer(ranking_call()))
    await backend.reload()
    assert (await in_flight).model_version == "1"
    assert (await backend.infer(ranking_call())).model_version == "2"


async def test_periodic_rescan_serves_new_version(repository: Path) -> None:
    """With a rescan interval, a new version is picked up without any call to reload."""
    backend = OnnxBackend("cpu", options(repository, rescan_interval_s=0.01))
    await backend.start()
    try:
        write_model_version(repository, "text-encoder", 2, seed=2)
        await wait_for(
            lambda: (spec := backend.model("text-encoder")) is not None and spec.version == "2",
            what="version 2 picked up",
        )
        _, _, result = await serve(backend, synthetic("text-encoder", 2))
    finally:
        await backend.aclose()
    assert result.model_version == "2"


async def test_failed_reload_keeps_serving(backend: OnnxBackend, repository: Path) -> None:
    """A config broken at run time fails the reload, and the loaded versions keep serving."""
    (repository / "rank-mlp" / "config.pbtxt").write_text("max_batch_size: {")
    with pytest.raises(ModelRepositoryError, match=r"rank-mlp/config\.pbtxt: config"):
        await backend.reload()
    assert (await backend.infer(ranking_call())).model_version == "1"


async def test_periodic_rescan_failure_is_counted(repository: Path) -> None:
    """A failing periodic rescan is counted and the backend stays SERVING."""
    backend = OnnxBackend("cpu", options(repository, rescan_interval_s=0.01))
    await backend.start()
    try:
        (repository / "rank-mlp" / "config.pbtxt").write_text("max_batch_size: {")
        await wait_for(lambda: backend.rescan_failures > 0, what="rescan failure counted")
        assert backend.health() is BackendHealth.SERVING
    finally:
        await backend.aclose()


async def test_unknown_model_is_model_not_found(backend: OnnxBackend) -> None:
    """A model the repository does not hold raises ModelNotFound."""
    call = InferCall("resnet-50", "", {"x": np.zeros((1, 3), np.float32)}, Priority.REALTIME, 1.0)
    with pytest.raises(ModelNotFound) as caught:
        await backend.infer(call)
    assert (caught.value.status, caught.value.retryable) == ("MODEL_NOT_FOUND", False)


async def test_unknown_version_is_model_not_found(backend: OnnxBackend) -> None:
    """A version that is not loaded raises ModelNotFound."""
    with pytest.raises(ModelNotFound):
        await backend.infer(ranking_call("7"))


async def test_expired_timeout_is_deadline_exceeded(backend: OnnxBackend) -> None:
    """A call whose deadline has already passed is refused as DEADLINE_EXCEEDED, not retryable."""
    with pytest.raises(BackendError) as caught:
        await backend.infer(ranking_call(timeout_s=0.0))
    assert (caught.value.status, caught.value.retryable) == ("DEADLINE_EXCEEDED", False)


async def test_deadline_passing_in_the_queue_is_deadline_exceeded(repository: Path) -> None:
    """A deadline that passes before a worker picks the call up fails it without running the model."""
    ticks = itertools.count(0.0, 10.0)  # each reading of the clock is 10 s after the last
    backend = OnnxBackend("cpu", options(repository), clock=lambda: next(ticks))
    await backend.start()
    try:
        with pytest.raises(BackendError) as caught:
            await backend.infer(ranking_call(timeout_s=1.0))
        assert caught.value.status == "DEADLINE_EXCEEDED"
    finally:
        await backend.aclose()


async def test_wrong_dtype_is_invalid_argument(backend: OnnxBackend) -> None:
    """Float64 features for a float32 model are refused before the model runs."""
    items = np.zeros((2, 1), dtype=np.int64)
    call = InferCall(
        "rank-mlp", "", {"features": np.zeros((2, 40)), "item_rows": items}, Priority.REALTIME, 1.0
    )
    with pytest.raises(BackendError, match="float64") as caught:
        await backend.infer(call)
    assert caught.value.status == "INVALID_ARGUMENT"


async def test_batch_over_max_batch_size_is_invalid_argument(backend: OnnxBackend) -> None:
    """More rows than max_batch_size are refused."""
    with pytest.raises(BackendError, match="max_batch_size") as caught:
        await backend.infer(ranking_call(rows=8193))
    assert caught.value.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize("threads", [1, 3])
async def test_worker_threads_are_bounded(repository: Path, threads: int) -> None:
    """However many calls are in flight, at most ``threads`` worker threads run them."""
    backend = OnnxBackend("bounded", options(repository, threads=threads))
    await backend.start()
    try:
        results = await asyncio.gather(*(backend.infer(ranking_call()) for _ in range(64)))
        workers = [t for t in threading.enumerate() if t.name.startswith(backend.thread_name_prefix)]
        assert len(results) == 64
        assert 1 <= len(workers) <= threads
    finally:
        await backend.aclose()


async def test_health_follows_the_lifecycle(repository: Path) -> None:
    """NOT_SERVING before start, SERVING once models are loaded, NOT_SERVING after close."""
    backend = OnnxBackend("cpu", options(repository))
    assert backend.health() is BackendHealth.NOT_SERVING
    await backend.start()
    assert backend.health() is BackendHealth.SERVING
    await backend.aclose()
    assert backend.health() is BackendHealth.NOT_SERVING


async def test_aclose_before_start_and_twice_is_safe(repository: Path) -> None:
    """aclose may be called before start and again after."""
    backend = OnnxBackend("cpu", options(repository))
    await backend.aclose()
    await backend.aclose()
    assert backend.health() is BackendHealth.NOT_SERVING


async def test_closed_backend_refuses_calls_as_unavailable(backend: OnnxBackend) -> None:
    """After aclose, calls fail as retryable UNAVAILABLE."""
    await backend.aclose()
    await backend.aclose()
    with pytest.raises(BackendError) as caught:
        await backend.infer(ranking_call())
    assert (caught.value.status, caught.value.retryable) == ("UNAVAILABLE", True)


async def test_config_input_missing_from_model_fails_start(repository: Path) -> None:
    """A config naming an input the ONNX graph lacks fails start, naming the config field."""
    config = repository / "rank-mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace('"features"', '"feats"'))
    backend = OnnxBackend("cpu", options(repository))
    with pytest.raises(ModelRepositoryError, match="input\\[0\\]: feats float32"):
        await backend.start()
    await backend.aclose()


async def test_non_onnx_model_fails_start(repository: Path) -> None:
    """A model for another Triton backend is refused, naming the backend field."""
    config = repository / "rank-mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace('"onnxruntime"', '"tensorrt"'))
    backend = OnnxBackend("cpu", options(repository))
    with pytest.raises(ModelRepositoryError, match="backend: 'tensorrt'"):
        await backend.start()
    await backend.aclose()


def test_builtin_registers_onnx_and_null() -> None:
    """Importing gateway.backends.builtin registers both shipped backend types."""
    assert {"onnx", "null"} <= set(registered_types())


def test_factory_builds_from_a_config_section(repository: Path) -> None:
    """create("onnx", ...) reads the options mapping."""
    backend = create("onnx", "cpu", {"repository": str(repository), "threads": 4, "pins": {"rank-mlp": 1}})
    assert isinstance(backend, OnnxBackend)
    assert (backend.options.threads, backend.options.pins) == (4, {"rank-mlp": "1"})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({}, "'repository' is required"),
        ({"repository": "/m", "thread": 2}, "unknown option 'thread'"),
        ({"repository": "/m", "threads": 0}, "'threads' must be a positive integer"),
        ({"repository": "/m", "rescan_interval_s": -1}, "'rescan_interval_s' must be a number >= 0"),
    ],
)
def test_factory_names_the_bad_option(section: dict[str, object], message: str) -> None:
    """A bad backend section is a ValueError naming the backend and the option."""
    with pytest.raises(ValueError, match=f"backend 'cpu': .*{message}"):
        create("onnx", "cpu", section)
