"""The rayserve backend against a real local Ray cluster serving deploy/rayserve over Ray's gRPC proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest

from gateway.backends.kserve.backend import KServeBackend
from gateway.backends.kserve.dialect import ServerAnswer
from gateway.backends.rayserve import RayServeDialect
from gateway.testing_servers import RayServeEndpoint, RayServeProxy
from inference.backends.base import BackendError, BackendHealth, ModelNotFound, create
from inference.backends.onnx import OnnxBackend
from inference.models.demo import IMAGE_MODEL, RANKING_MODEL, TEXT_MODEL, write_demo_repository
from routing.types import Priority
from tests.gateway.backends.test_triton_backend import assert_some_overloaded, call

pytestmark = pytest.mark.rayserve


def rayserve_backend(endpoint: RayServeEndpoint, **options: object) -> KServeBackend:
    backend = create(
        "rayserve",
        "ray",
        {"url": endpoint.grpc_url, "application": endpoint.application, "health_interval_s": 0.5, **options},
    )
    assert isinstance(backend, KServeBackend)
    return backend


@pytest.fixture
async def remote(rayserve: RayServeEndpoint) -> AsyncIterator[KServeBackend]:
    backend = rayserve_backend(rayserve)
    await backend.start()
    yield backend
    await backend.aclose()


@pytest.fixture(scope="module")
def slow_rayserve(
    ray_serve: RayServeProxy, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RayServeEndpoint]:
    """A second application: one slow replica (0.5 s per batch) that queues at most 2 requests."""
    root = tmp_path_factory.mktemp("slow-rayserve-models")
    write_demo_repository(root)
    args = {
        "num_cpus": 0.5,
        "max_batch_size": 1,
        "max_ongoing_requests": 1,
        "max_queued_requests": 2,
        "test_execute_delay_s": 0.5,
    }
    yield ray_serve.deploy(root, application="hk-slow", app_args=args)
    ray_serve.delete("hk-slow")


async def test_serves_the_repository_models_batched_by_ray(remote: KServeBackend) -> None:
    """Models come from the application's repository index; it batches, so the gateway does not."""
    assert remote.health() is BackendHealth.SERVING
    for model in (RANKING_MODEL, TEXT_MODEL, IMAGE_MODEL):
        spec = remote.model(model)
        assert spec is not None and spec.server_batching and spec.version == "1"


@pytest.mark.parametrize("model", [RANKING_MODEL, TEXT_MODEL, IMAGE_MODEL])
async def test_outputs_equal_the_embedded_backend(
    remote: KServeBackend, backend: OnnxBackend, model: str
) -> None:
    """The same inputs through Ray Serve and through embedded ONNX Runtime give the same outputs."""
    over_ray = await remote.infer(call(model, 4))
    embedded = await backend.infer(call(model, 4))
    assert over_ray.model_version == "1"
    for name, expected in embedded.outputs.items():
        np.testing.assert_allclose(over_ray.outputs[name], expected, rtol=1e-5, atol=1e-6)


async def test_concurrent_calls_are_batched_and_each_gets_its_own_rows(remote: KServeBackend) -> None:
    """Calls of different sizes that Ray batches together come back split correctly."""
    calls = [call(RANKING_MODEL, rows, seed=rows) for rows in (1, 7, 3, 12, 5)]
    results = await asyncio.gather(*(remote.infer(c) for c in calls))
    for c, result in zip(calls, results, strict=True):
        alone = await remote.infer(c)
        assert result.outputs["scores"].shape == (len(c.inputs["features"]), 1)
        np.testing.assert_allclose(result.outputs["scores"], alone.outputs["scores"], rtol=1e-5, atol=1e-6)


async def test_unknown_model_is_model_not_found(remote: KServeBackend) -> None:
    with pytest.raises(ModelNotFound):
        await remote.infer(call("no-such-model", 1))


async def test_backpressure_is_overloaded(slow_rayserve: RayServeEndpoint) -> None:
    """Past max_queued_requests Ray answers RESOURCE_EXHAUSTED: OVERLOADED, shed and retried elsewhere."""
    remote = rayserve_backend(slow_rayserve)
    await remote.start()
    try:
        results = await asyncio.gather(
            *(remote.infer(call(RANKING_MODEL, 2, seed=i)) for i in range(8)), return_exceptions=True
        )
    finally:
        await remote.aclose()
    assert_some_overloaded(results)


async def test_deadline_is_the_call_timeout(slow_rayserve: RayServeEndpoint) -> None:
    """A deadline shorter than the replica's work comes back DEADLINE_EXCEEDED: the call's timeout is the
    gRPC deadline (without it the call would wait out the replica's work and succeed)."""
    remote = rayserve_backend(slow_rayserve)
    await remote.start()
    try:
        with pytest.raises(BackendError) as caught:
            await remote.infer(call(RANKING_MODEL, 2, timeout_s=0.15))
    finally:
        await remote.aclose()
    assert caught.value.status == "DEADLINE_EXCEEDED", caught.value


def test_missing_application_is_unavailable_not_model_not_found() -> None:
    """Ray's "Application ... not found" means the app is being (re)deployed: retry elsewhere."""
    error = RayServeDialect("hk-models").error(
        ServerAnswer("NOT_FOUND", "Application 'hk-models' not found. Ping ..."), call(RANKING_MODEL, 1)
    )
    assert (error.status, error.retryable) == ("UNAVAILABLE", True)


def test_headers_name_the_application() -> None:
    assert RayServeDialect("apps-a").headers() == {"application": "apps-a"}
    assert RayServeDialect("apps-a").priority(Priority.REALTIME, 3) == 0


def test_bad_application_option_is_refused() -> None:
    with pytest.raises(ValueError, match="application"):
        create("rayserve", "ray", {"url": "127.0.0.1:9000", "application": ""})


def test_an_unknown_option_is_refused_naming_every_known_one() -> None:
    """A typo is an error listing what the backend takes, its own ``application`` included."""
    with pytest.raises(ValueError, match="unknown option 'aplication'") as raised:
        create("rayserve", "ray", {"url": "127.0.0.1:9000", "aplication": "hk-models"})
    known = str(raised.value).partition("known: ")[2].split(", ")
    assert {"application", "url"} <= set(known)
