"""One bad request fails only itself: the rest of its batch is served, as the agents that sent it see it."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgewire import pb
from gateway.dispatch.pool import for_operator
from gateway.server import Gateway
from gateway.testing import WireClient, fresh_requests, run_gateway
from inference.backends.base import InferCall, InferResult, ModelSpec
from inference.pipeline import worker as worker_module
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import tensor_from_array
from inference.pipeline.worker import finish_batch, prepare_requests
from routing.config import DEFAULT_ROUTING_SECTION
from tests.gateway.daemon.faults import prepare_or_stop
from tests.gateway.daemon.test_serving import synthetic

PIXELS = (3, 64, 64)  # the demo image-classifier's input, served here as a generic tensor model


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def tensor_serving(**cpu_pool: Any) -> dict[str, Any]:
    """Overrides that serve the demo image-classifier (max_batch_size 32) through the generic tensor
    pipeline on the CPU pool, batched as ``cpu_pool`` says."""
    routing = copy.deepcopy(DEFAULT_ROUTING_SECTION)
    routing["models"]["image-classifier"] = {"kind": "tensor"}
    for pool in routing["pools"]:
        pool["max_queue_depth"] = 1000
    return {
        "pipelines": {"image-classifier": {"pipeline": "tensor"}},
        "pools": {"cpu": {"backend": "embedded", **cpu_pool}},
        "routing": routing,
    }


def pixel_requests(n: int, seed: int = 0) -> list[pb.InferRequest]:
    """``n`` valid TENSOR requests of one [1, 3, 64, 64] FP32 image each, for the CPU pool."""
    rng = np.random.default_rng(seed)
    requests = [
        pb.InferRequest(
            model_name="image-classifier",
            kind=pb.REQUEST_KIND_TENSOR,
            complexity_hint=0.0,  # the CPU pool
            inputs=[tensor_from_array("pixels", rng.standard_normal((1, *PIXELS)).astype(np.float32))],
        )
        for _ in range(n)
    ]
    return fresh_requests(requests, budget_s=30)


def poison_pill() -> pb.InferRequest:
    """A TENSOR request whose shape has 65 dims (numpy takes at most 64), its bytes matching its count."""
    shape = [1] * 62 + list(PIXELS)
    tensor = pb.Tensor(
        name="pixels", datatype=pb.DATA_TYPE_FP32, shape=shape, raw_data=bytes(4 * int(np.prod(shape)))
    )
    request = pb.InferRequest(
        model_name="image-classifier", kind=pb.REQUEST_KIND_TENSOR, complexity_hint=0.0, inputs=[tensor]
    )
    return fresh_requests([request], budget_s=30)[0]


async def test_a_poison_pill_fails_alone_and_the_other_agents_requests_in_its_batch_are_served(
    models_dir: Path,
) -> None:
    """One agent's 65-dim tensor, batched with another agent's valid requests, is answered
    INVALID_ARGUMENT bad_tensor; every valid request of that batch is answered OK."""
    overrides = tensor_serving(max_batch_size=8, preferred_batch_sizes=[8], max_queue_delay_us=20_000_000)
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="honest") as honest,
        WireClient(gw.endpoint("pccw"), agent_id="hostile") as hostile,
    ):
        valid, pill = pixel_requests(7), poison_pill()
        valid_ack = await honest.wait_ack(await honest.send(valid))
        pill_ack = await hostile.wait_ack(await hostile.send([pill]))
        served = await honest.wait_responses([r.request_id for r in valid])
        (refused,) = await hostile.wait_responses([pill.request_id])
        batches = sample(gw, "hkgw_batch_size_count", pool="cpu")
    assert len(valid_ack.accepted_ids) == 7 and len(pill_ack.accepted_ids) == 1
    assert batches == 1  # the pill and the valid requests were one batch (8 = the preferred size)
    assert [r.status for r in served] == [pb.STATUS_OK] * 7, {r.error_message for r in served}
    assert refused.status == pb.STATUS_INVALID_ARGUMENT
    assert refused.error_message.startswith("bad_tensor: "), refused.error_message
    assert sample(gw, "hkgw_input_rejected_total", model="image-classifier", reason="bad_tensor") == 1


async def test_a_pool_batching_more_than_the_model_takes_serves_every_valid_request(
    models_dir: Path,
) -> None:
    """200 valid tensor requests through a pool batching 64 for a model that takes 32: all OK, in
    batches the pool cut at 32."""
    overrides = tensor_serving(max_batch_size=64, preferred_batch_sizes=[64], max_queue_delay_us=50_000)
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        requests = pixel_requests(200, seed=1)
        frames = [await agent.send(requests[i : i + 50]) for i in range(0, 200, 50)]  # 8 MiB frame limit
        acks = [await agent.wait_ack(frame) for frame in frames]
        responses = await agent.wait_responses([r.request_id for r in requests], timeout_s=60)
        rejected = sample(gw, "hkgw_input_rejected_total", model="image-classifier", reason="too_large")
        batches = sample(gw, "hkgw_batch_size_count", pool="cpu")
        within = sample(gw, "hkgw_batch_size_bucket", pool="cpu", le="32.0")
    assert sum(len(ack.accepted_ids) for ack in acks) == 200
    assert [r.status for r in responses] == [pb.STATUS_OK] * 200, {r.error_message for r in responses}
    assert all(r.pool == "cpu" for r in responses)
    assert rejected == 0
    assert batches >= 7 and within == batches  # cut at the model's 32, not the pool's 64


POISON = "poison"  # the tenant of the request the injected faults below fail on


def _poisoned(requests: Sequence[pb.InferRequest]) -> bool:
    return any(r.tenant == POISON for r in requests)


@pytest.mark.parametrize("stage", ["prepare", "infer", "finish"])
async def test_a_stage_raising_on_one_request_fails_that_request_alone(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """A pipeline or backend adapter that raises (a bug) on one request of a batch: the batch is split in
    halves until that request is alone; it is answered INTERNAL in plain words, the rest are served and
    the breaker stays closed. Each split is counted (8 -> 4 -> 2 -> 1: three)."""
    if stage == "prepare":

        def prepare(
            pipeline: str, spec: ModelSpec, requests: Sequence[pb.InferRequest], payloads: Any = None
        ) -> Prepared:
            if _poisoned(requests):
                raise ValueError("injected: prepare fails on this batch")
            return prepare_requests(pipeline, spec, requests, payloads)

        monkeypatch.setattr(worker_module, "prepare_requests", prepare)
    elif stage == "finish":

        def marked(
            pipeline: str, spec: ModelSpec, requests: Sequence[pb.InferRequest], payloads: Any = None
        ) -> Prepared:
            prepared = prepare_requests(pipeline, spec, requests, payloads)
            if _poisoned(requests):
                prepared.extras[POISON] = np.ones(1)  # what finish sees of the requests
            return prepared

        def finish(pipeline: str, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
            if POISON in prepared.extras:
                raise ValueError("injected: finish fails on this batch")
            return finish_batch(pipeline, prepared, outputs)

        monkeypatch.setattr(worker_module, "prepare_requests", marked)
        monkeypatch.setattr(worker_module, "finish_batch", finish)
    overrides = tensor_serving(max_batch_size=8, preferred_batch_sizes=[8], max_queue_delay_us=20_000_000)
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="honest") as honest,
        WireClient(gw.endpoint("pccw"), agent_id="hostile") as hostile,
    ):
        if stage == "infer":
            backend = gw.pools["cpu"].backend
            real_infer = backend.infer
            marker = np.float32(1234.5)

            async def infer(call: InferCall) -> InferResult:
                if np.any(call.inputs["pixels"].reshape(len(call.inputs["pixels"]), -1)[:, 0] == marker):
                    raise RuntimeError("injected: the adapter fails on this batch")
                return await real_infer(call)

            monkeypatch.setattr(backend, "infer", infer)
        valid, bad = pixel_requests(7), pixel_requests(1, seed=9)[0]
        bad.tenant = POISON
        pixels = np.full((1, *PIXELS), 1234.5, dtype=np.float32)
        bad.inputs[0].CopyFrom(tensor_from_array("pixels", pixels))
        await honest.wait_ack(await honest.send(valid))
        await hostile.wait_ack(await hostile.send([bad]))
        served = await honest.wait_responses([r.request_id for r in valid])
        (failed,) = await hostile.wait_responses([bad.request_id])
        splits = sample(gw, "hkgw_batch_isolations_total", pool="cpu", stage=stage, how="split")
        breaker = sample(gw, "hkgw_breaker_state", backend="embedded")
    assert [r.status for r in served] == [pb.STATUS_OK] * 7, {r.error_message for r in served}
    assert failed.status == pb.STATUS_INTERNAL
    assert "injected" not in failed.error_message and "Error" not in failed.error_message
    assert failed.error_message.startswith("internal error"), failed.error_message
    assert splits == 3
    assert breaker == 0  # closed: one bad request does not open it


@pytest.mark.parametrize(
    ("fault", "status"), [("hang", pb.STATUS_INTERNAL), ("crash", pb.STATUS_UNAVAILABLE)]
)
async def test_the_other_requests_of_a_batch_whose_cpu_task_hung_or_crashed_are_retried_and_served(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str, status: int
) -> None:
    """A batch whose CPU task hangs past task_timeout_s (or kills its worker): each of its requests is
    retried once on its own in a worker; the one that hangs (crashes) again fails alone, INTERNAL
    (UNAVAILABLE, retryable), and the other requests of that batch are served."""
    monkeypatch.setattr(worker_module, "prepare_batch", prepare_or_stop)
    cpu = {"mode": "process", "workers": 2, "inline_max_requests": 0, "task_timeout_s": 1.0}
    async with run_gateway(models_dir=models_dir, cpu=cpu) as gw, WireClient(gw.endpoint("hgc")) as agent:
        requests = synthetic(6, seed=5, kind=pb.REQUEST_KIND_RANKING)
        for request in requests:
            request.complexity_hint = 0.0  # the CPU pool, one batch
        requests[2].tenant = fault
        responses = await agent.infer(requests, timeout_s=30)
        retried = sample(gw, "hkgw_batch_isolations_total", pool="cpu", stage="prepare", how="singly")
        timeouts = sample(gw, "hkgw_cpu_task_timeouts_total")
    assert [r.status for i, r in enumerate(responses) if i != 2] == [pb.STATUS_OK] * 5, [
        r.error_message for r in responses
    ]
    assert responses[2].status == status
    assert "0x" not in responses[2].error_message
    assert retried == 1
    assert timeouts == (2 if fault == "hang" else 0)
    if fault == "hang":
        assert "task_timeout_s" in responses[2].error_message
    else:
        assert responses[2].retry_after_ms > 0


@pytest.mark.filterwarnings("error::RuntimeWarning")
async def test_nan_and_infinite_features_are_refused_and_huge_ones_served(models_dir: Path) -> None:
    """Ranking requests with a NaN candidate feature or an infinite user feature are answered
    INVALID_ARGUMENT bad_features naming the field; one with float32's largest value is served (clipped);
    the valid one beside them is served; numpy warns about nothing (a warning fails this test)."""
    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        requests = synthetic(4, seed=8, kind=pb.REQUEST_KIND_RANKING)
        for request in requests:
            request.complexity_hint = 0.0  # the CPU pool: a small batch, prepared on the event loop
        requests[1].ranking.candidate_dense[0] = float("nan")
        requests[2].ranking.user_dense[1] = float("inf")
        requests[3].ranking.candidate_dense[1] = float(np.finfo(np.float32).max)
        responses = await agent.infer(requests)
        refused = sample(gw, "hkgw_input_rejected_total", model="rank-mlp", reason="bad_features")
    assert [r.status for r in responses] == [
        pb.STATUS_OK,
        pb.STATUS_INVALID_ARGUMENT,
        pb.STATUS_INVALID_ARGUMENT,
        pb.STATUS_OK,
    ], [r.error_message for r in responses]
    assert responses[1].error_message.startswith("bad_features: candidate_dense holds NaN or infinity")
    assert responses[2].error_message.startswith("bad_features: user_dense holds NaN or infinity")
    assert refused == 2


@pytest.mark.parametrize(
    ("message", "read"),
    [
        ("cannot identify image file <_io.BytesIO object at 0x7f3a2c1d>", "cannot identify image file"),
        (
            "Traceback (most recent call last):\n  File x\nValueError: y",
            "internal error; the gateway logged it",
        ),
        ("model failed\ndetails the agent cannot use", "model failed"),
        ("x" * 600, "x" * 512),
    ],
    ids=["repr", "traceback", "lines", "long"],
)
def test_error_messages_are_written_for_the_agents_operator(message: str, read: str) -> None:
    """Whatever a pipeline or backend put in an error, the agent reads one plain line: no object reprs,
    no traceback, at most 512 characters."""
    assert for_operator(message) == read
