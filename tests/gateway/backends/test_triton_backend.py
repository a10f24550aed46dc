"""The triton backend against a real tritonserver (CPU, python backend running the demo ONNX models)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from gateway.backends.kserve.backend import KServeBackend
from gateway.backends.kserve.dialect import ServerAnswer
from gateway.backends.kserve.options import KServeOptions
from gateway.backends.triton import TritonDialect
from gateway.testing import wait_for
from gateway.testing_servers import TritonServer, TritonTls
from inference.backends.base import BackendError, BackendHealth, InferCall, ModelNotFound, create
from inference.backends.onnx import OnnxBackend
from inference.models.demo import IMAGE_MODEL, RANKING_MODEL, TEXT_MODEL
from routing.types import Priority
from tests.gateway.backends.pki import SERVER_NAME, make_pki

pytestmark = pytest.mark.triton


def triton_backend(url: str, **options: object) -> KServeBackend:
    backend = create("triton", "triton", {"url": url, "health_interval_s": 0.2, **options})
    assert isinstance(backend, KServeBackend)
    return backend


@pytest.fixture
async def remote(triton: TritonServer) -> AsyncIterator[KServeBackend]:
    backend = triton_backend(triton.grpc_url)
    await backend.start()
    yield backend
    await backend.aclose()


def assert_some_overloaded(results: list[object]) -> None:
    """Some calls were served and every other one was refused as OVERLOADED (shed, not failed)."""
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and len(errors) < len(results)
    assert all(isinstance(e, BackendError) and e.overloaded and e.status == "OVERLOADED" for e in errors), (
        errors
    )


async def wait_queued(server: TritonServer, condition: Callable[[int], bool]) -> None:
    """Poll (with a deadline) until the number of image-model calls Triton's scheduler holds meets
    ``condition``. Full-size calls run one per execution of the one slow instance, so two calls sent
    together leave one queued for a whole execution: then the instance is busy and calls sent next queue.
    The gauge counts a call from its arrival to its hand-off to the instance, so it may read 1 while the
    first of the two is not yet handed off and the second still on its way: the queue holds 3, so a third
    call sent then is queued all the same (with 2 it was once refused OVERLOADED)."""
    deadline = time.monotonic() + 10.0
    while not condition(held := await asyncio.to_thread(server.pending_requests, IMAGE_MODEL)):
        assert time.monotonic() < deadline, f"Triton holds {held} image-model calls"
        await asyncio.sleep(0.01)


def inputs(model: str, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if model == RANKING_MODEL:
        rows_in_table = rng.integers(0, 4096, (rows, 1), dtype=np.int64)
        return {"features": rng.random((rows, 40), dtype=np.float32), "item_rows": rows_in_table}
    if model == TEXT_MODEL:
        ids = rng.integers(1, 8192, (rows, 12), dtype=np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return {"pixels": rng.random((rows, 3, 64, 64), dtype=np.float32)}


def call(
    model: str,
    rows: int,
    *,
    version: str = "",
    priority: Priority = Priority.INTERACTIVE,
    timeout_s: float | None = 10.0,
    seed: int = 0,
) -> InferCall:
    return InferCall(model, version, inputs(model, rows, seed), priority, timeout_s)


async def test_discovers_served_models_from_the_server(remote: KServeBackend, backend: OnnxBackend) -> None:
    """Specs come from Triton's ModelConfig: same tensors and pipeline as the embedded backend reads."""
    assert remote.health() is BackendHealth.SERVING
    for model in (RANKING_MODEL, TEXT_MODEL, IMAGE_MODEL):
        spec, local = remote.model(model), backend.model(model)
        assert spec is not None and local is not None
        assert (spec.inputs, spec.outputs, spec.pipeline) == (local.inputs, local.outputs, local.pipeline)
        assert spec.server_batching  # dynamic_batching in config.pbtxt: the gateway does not batch twice
        assert spec.version == "2"  # the latest of the two loaded versions
    assert remote.model("no-such-model") is None


@pytest.mark.parametrize("model", [RANKING_MODEL, TEXT_MODEL, IMAGE_MODEL])
async def test_outputs_equal_the_embedded_backend(
    remote: KServeBackend, backend: OnnxBackend, model: str
) -> None:
    """The same inputs through Triton and through embedded ONNX Runtime give the same outputs (version 1)."""
    over_triton = await remote.infer(call(model, 5, version="1"))
    embedded = await backend.infer(call(model, 5, version="1"))
    assert over_triton.model_version == "1"
    for name, expected in embedded.outputs.items():
        np.testing.assert_allclose(over_triton.outputs[name], expected, rtol=1e-5, atol=1e-6)


async def test_pinned_version_is_the_default(triton: TritonServer) -> None:
    """With a pin, an unversioned call is served by the pinned version, not the latest."""
    pinned = triton_backend(triton.grpc_url, pins={RANKING_MODEL: 1})
    await pinned.start()
    try:
        v1 = await pinned.infer(call(RANKING_MODEL, 3))
        v2 = await pinned.infer(call(RANKING_MODEL, 3, version="2"))
    finally:
        await pinned.aclose()
    assert (v1.model_version, v2.model_version) == ("1", "2")
    assert not np.allclose(v1.outputs["scores"], v2.outputs["scores"])


async def test_unknown_model_is_model_not_found(remote: KServeBackend) -> None:
    """A model Triton does not serve is refused before any call, as MODEL_NOT_FOUND."""
    with pytest.raises(ModelNotFound):
        await remote.infer(call("no-such-model", 1))


def test_priority_classes_map_to_triton_levels() -> None:
    """Realtime is level 1 (highest), batch the model's lowest; no levels means the default (0)."""
    dialect = TritonDialect()
    assert dialect.priority(Priority.REALTIME, 3) == 1
    assert dialect.priority(Priority.INTERACTIVE, 3) == 2
    assert dialect.priority(Priority.BATCH, 3) == 3
    assert dialect.priority(Priority.BATCH, 5) == 5
    assert dialect.priority(Priority.INTERACTIVE, 1) == 1
    assert dialect.priority(Priority.BATCH, 0) == 0


def test_triton_answers_map_to_gateway_statuses() -> None:
    """Queue timeout -> DEADLINE_EXCEEDED; queue full and RESOURCE_EXHAUSTED -> OVERLOADED; down -> retry."""
    dialect, probe = TritonDialect(), call(IMAGE_MODEL, 1)
    timeout = dialect.error(ServerAnswer("UNAVAILABLE", "Request timeout expired"), probe)
    full = dialect.error(
        ServerAnswer("UNAVAILABLE", "[request id: <id_unknown>] Exceeds maximum queue size"), probe
    )
    exhausted = dialect.error(ServerAnswer("RESOURCE_EXHAUSTED", "no room"), probe)
    down = dialect.error(ServerAnswer("UNAVAILABLE", "failed to connect to all addresses"), probe)
    assert (timeout.status, timeout.retryable) == ("DEADLINE_EXCEEDED", False)
    assert full.overloaded and full.status == "OVERLOADED"
    assert exhausted.overloaded and exhausted.status == "OVERLOADED"
    assert (down.status, down.retryable, down.overloaded) == ("UNAVAILABLE", True, False)


async def test_priority_reaches_triton(slow_triton: TritonServer) -> None:
    """Queued behind a busy instance, a realtime call sent after a batch call is served before it."""
    remote = triton_backend(slow_triton.grpc_url)
    await remote.start()
    finished: list[str] = []

    async def run(label: str, priority: Priority) -> None:
        await remote.infer(call(IMAGE_MODEL, 32, priority=priority))  # 32 = max_batch_size: one per execution
        finished.append(label)

    try:
        busy = [asyncio.create_task(run("busy", Priority.INTERACTIVE)) for _ in range(2)]
        await wait_queued(slow_triton, lambda held: held == 1)
        batch = asyncio.create_task(run("batch", Priority.BATCH))
        # The batch call is queued before the realtime one is sent (a busy call may finish meanwhile).
        await wait_queued(slow_triton, lambda held: held + len(finished) == 2)
        realtime = asyncio.create_task(run("realtime", Priority.REALTIME))
        await asyncio.gather(*busy, batch, realtime)
    finally:
        await remote.aclose()
    assert finished.index("realtime") < finished.index("batch"), finished


async def test_deadline_passing_in_triton_queue_is_deadline_exceeded_not_late(
    slow_triton: TritonServer,
) -> None:
    """Behind a busy instance, a call whose deadline passes in the queue comes back at its deadline."""
    remote = triton_backend(slow_triton.grpc_url)
    await remote.start()
    try:
        busy = [asyncio.create_task(remote.infer(call(IMAGE_MODEL, 32, seed=i))) for i in range(2)]
        await wait_queued(slow_triton, lambda held: held == 1)
        with pytest.raises(BackendError) as caught:
            await remote.infer(call(IMAGE_MODEL, 1, timeout_s=0.1))
        answered_before_the_queue = not all(b.done() for b in busy)
        await asyncio.gather(*busy)
    finally:
        await remote.aclose()
    assert caught.value.status == "DEADLINE_EXCEEDED"
    assert not caught.value.retryable
    # Queued behind a busy call, answered while that call still waits: at its deadline, not after it.
    assert answered_before_the_queue


async def test_triton_queue_policy_rejects_a_request_whose_own_timeout_passed(
    slow_triton: TritonServer,
) -> None:
    """The shipped config lets a request's timeout override the queue's: Triton rejects it, we map it."""
    client = triton_aio.InferenceServerClient(slow_triton.grpc_url)

    def pixels(rows: int) -> list[InferInput]:
        tensor = InferInput("pixels", [rows, 3, 64, 64], "FP32")
        tensor.set_data_from_numpy(np.zeros((rows, 3, 64, 64), np.float32))
        return [tensor]

    try:
        busy = [asyncio.create_task(client.infer(IMAGE_MODEL, pixels(32))) for _ in range(2)]
        await wait_queued(slow_triton, lambda held: held == 1)
        with pytest.raises(InferenceServerException) as caught:
            await client.infer(IMAGE_MODEL, pixels(1), timeout=50_000)  # 50 ms, no client-side deadline
        await asyncio.gather(*busy)
    finally:
        await client.close()
    mapped = TritonDialect().error(
        ServerAnswer(str(caught.value.status()).removeprefix("StatusCode."), caught.value.message() or ""),
        call(IMAGE_MODEL, 1),
    )
    assert mapped.status == "DEADLINE_EXCEEDED", caught.value.message()


async def test_full_triton_queue_is_overloaded(slow_triton: TritonServer) -> None:
    """More full-size calls than the instance and its queue of 3 hold: the rest are OVERLOADED, not failed."""
    remote = triton_backend(slow_triton.grpc_url)
    await remote.start()
    try:
        results = await asyncio.gather(
            *(remote.infer(call(IMAGE_MODEL, 32, seed=i)) for i in range(6)), return_exceptions=True
        )
    finally:
        await remote.aclose()
    assert_some_overloaded(results)


async def test_killed_server_is_unavailable_then_serving_again(
    triton_repository: Path, tmp_path: Path
) -> None:
    """A killed tritonserver: calls fail retryably and health drops; restarted, it serves again."""
    server = TritonServer(triton_repository, (RANKING_MODEL,), log_path=tmp_path / "triton.log")
    await asyncio.to_thread(server.start)
    remote = triton_backend(server.grpc_url, models=[RANKING_MODEL])
    await remote.start()
    try:
        assert (await remote.infer(call(RANKING_MODEL, 2))).outputs["scores"].shape == (2, 1)
        await asyncio.to_thread(server.kill)
        with pytest.raises(BackendError) as caught:
            await remote.infer(call(RANKING_MODEL, 2))
        await remote.refresh()
        down = remote.health()
        await asyncio.to_thread(server.start)
        await wait_for(lambda: remote.health() is BackendHealth.SERVING, timeout_s=10)  # checked every 0.2 s
        after = await remote.infer(call(RANKING_MODEL, 2))
    finally:
        await remote.aclose()
        await asyncio.to_thread(server.stop)
    assert (caught.value.status, caught.value.retryable) == ("UNAVAILABLE", True)
    assert down is BackendHealth.NOT_SERVING
    assert after.outputs["scores"].shape == (2, 1)
    assert remote.model(TEXT_MODEL) is None  # `models` limits what this backend serves


async def test_start_with_the_server_down_reports_not_serving() -> None:
    """A gateway starts while its Triton is down: the backend is NOT_SERVING instead of failing start."""
    from gateway.testing_servers import free_port

    remote = triton_backend(f"127.0.0.1:{free_port()}", control_timeout_s=0.5)
    await remote.start()
    try:
        assert remote.health() is BackendHealth.NOT_SERVING
        with pytest.raises(ModelNotFound):
            await remote.infer(call(RANKING_MODEL, 1))
    finally:
        await remote.aclose()
    await remote.aclose()  # twice is safe


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "url"),
        ({"url": "http://127.0.0.1:8001"}, "url"),
        ({"url": "127.0.0.1:8001", "channels": 0}, "channels"),
        ({"url": "127.0.0.1:8001", "pins": {"m": "latest"}}, "pins"),
        ({"url": "127.0.0.1:8001", "health_interval_s": 0}, "health_interval_s"),
        ({"url": "127.0.0.1:8001", "colour": "blue"}, "colour"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, object], key: str) -> None:
    """Config mistakes fail at load time with the key named."""
    with pytest.raises(ValueError, match=key):
        KServeOptions.from_mapping("triton", options)


async def test_mutual_tls_to_a_tritonserver_that_requires_it(triton_repository: Path, tmp_path: Path) -> None:
    """Against a tritonserver that requires mutual TLS, the backend serves with the CA and a client
    certificate (also when it checks the server's name instead of its address); without the client
    certificate, trusting another CA, checking another name, or in plaintext, it is refused: NOT_SERVING,
    the failed checks counted, the start itself not failed."""
    pki = make_pki(tmp_path / "pki")
    other = make_pki(tmp_path / "other", ca_name="another CA")
    tls = TritonTls(pki.server_cert, pki.server_key, client_ca=pki.ca)
    server = TritonServer(triton_repository, (RANKING_MODEL,), log_path=tmp_path / "triton.log", tls=tls)
    mutual = pki.mutual_tls()
    attempts = {
        "by address": mutual,
        "by name": {**mutual, "tls_server_name": SERVER_NAME},
        "no client certificate": {"tls": True, "tls_ca_file": str(pki.ca)},
        "another CA": {**mutual, "tls_ca_file": str(other.ca)},
        "another name": {**mutual, "tls_server_name": "other.hk.test"},
        "plaintext": {},
    }
    outcome: dict[str, tuple[BackendHealth, int, tuple[int, ...] | None]] = {}
    await asyncio.to_thread(server.start)
    try:
        for label, options in attempts.items():
            remote = triton_backend(server.grpc_url, models=[RANKING_MODEL], control_timeout_s=1.0, **options)
            await remote.start()
            try:
                shape = None
                if remote.health() is BackendHealth.SERVING:
                    shape = (await remote.infer(call(RANKING_MODEL, 2))).outputs["scores"].shape
                outcome[label] = (remote.health(), remote.refresh_failures, shape)
            finally:
                await remote.aclose()
    finally:
        await asyncio.to_thread(server.stop)
    for label in ("by address", "by name"):
        assert outcome[label] == (BackendHealth.SERVING, 0, (2, 1)), (label, outcome[label])
    for label in ("no client certificate", "another CA", "another name", "plaintext"):
        health, failures, shape = outcome[label]
        assert (health, shape) == (BackendHealth.NOT_SERVING, None) and failures >= 1, (label, outcome[label])
