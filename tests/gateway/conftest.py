"""Real inference servers shared by the backend and daemon tests: Triton (CPU, python backend) and Ray Serve.

Each starts once per session on loopback; tests that kill a server start their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.models.triton import write_triton_repository
from gateway.testing_servers import RayServeEndpoint, RayServeProxy, TritonServer, local_ray
from inference.models.demo import DEMO_MODELS, IMAGE_MODEL

SLOW_S = 0.4  # each execution of slow_triton's model takes this long


@pytest.fixture(scope="session")
def triton_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo models for Triton (CPU instances, python backend running ONNX Runtime), versions 1 and 2."""
    root = tmp_path_factory.mktemp("triton-models")
    write_triton_repository(root, kind="cpu", runtime="python", versions=2)
    return root


@pytest.fixture(scope="session")
def triton(triton_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """One tritonserver for the session, on free loopback ports."""
    log = tmp_path_factory.mktemp("triton-log") / "tritonserver.log"
    with TritonServer(triton_repository, DEMO_MODELS, log_path=log) as server:
        yield server


@pytest.fixture(scope="session")
def slow_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """Image model only, one CPU instance, SLOW_S per execution (a stand-in for a busy GPU), a queue of 3."""
    root = tmp_path_factory.mktemp("slow-triton")
    write_triton_repository(
        root,
        kind="cpu",
        runtime="python",
        models=(IMAGE_MODEL,),
        max_queue_size=3,
        test_execute_delay_s=SLOW_S,
    )
    with TritonServer(root, (IMAGE_MODEL,), log_path=root / "tritonserver.log") as server:
        yield server


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster (2 CPUs) for the session; only ever inside the test's loopback-only namespace."""
    with local_ray(num_cpus=2):
        yield


@pytest.fixture(scope="session")
def ray_serve(ray_cluster: None) -> Iterator[RayServeProxy]:
    """Ray Serve's proxies on free loopback ports, for the session."""
    proxy = RayServeProxy()
    proxy.start()
    yield proxy
    proxy.shutdown()


@pytest.fixture(scope="session")
def rayserve(ray_serve: RayServeProxy, tmp_path_factory: pytest.TempPathFactory) -> RayServeEndpoint:
    """deploy/rayserve's application on the demo models (version 1), behind Ray Serve's gRPC proxy."""
    from inference.models.demo import write_demo_repository

    root = tmp_path_factory.mktemp("rayserve-models")
    write_demo_repository(root)
    return ray_serve.deploy(root, app_args={"num_cpus": 0.5, "max_batch_size": 16})
