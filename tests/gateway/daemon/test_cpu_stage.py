"""The CPU stage runs in worker processes; a worker that dies is replaced and its batch answered retryable."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from edgewire import pb
from gateway.dispatch import cpu as cpu_module
from gateway.dispatch.cpu import CpuStage
from gateway.ops.metrics import GatewayMetrics
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from inference.backends.base import BackendError, ModelSpec, TensorSpec
from inference.pipeline import worker as worker_module
from inference.pipeline.arena import ALIGN, FeatureArena, place
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import tensor_from_array
from tests.gateway.daemon.test_serving import synthetic
from tests.inference.pipeline.specs import demo_spec


async def test_pipelines_run_in_other_processes(models_dir: Path) -> None:
    """With mode=process the CPU stage's workers are separate processes that serve every request kind."""
    async with run_gateway(models_dir=models_dir, cpu={"mode": "process", "workers": 1}) as gw:
        assert gw.cpu is not None
        pids = gw.cpu.pids()
        assert pids
        assert os.getpid() not in pids
        async with WireClient(gw.endpoint("hgc")) as agent:
            responses = await agent.infer(synthetic(30, seed=61))
    assert all(r.status == pb.STATUS_OK for r in responses)


async def test_dead_worker_is_replaced_and_its_batch_answered(models_dir: Path) -> None:
    """Killing the CPU worker: affected requests are answered (served after reroute, or UNAVAILABLE with a
    retry-after), the pool is replaced, and the next requests are served."""
    async with run_gateway(models_dir=models_dir, cpu={"mode": "process", "workers": 1}) as gw:
        assert gw.cpu is not None
        (victim,) = gw.cpu.pids()
        os.kill(victim, signal.SIGKILL)
        requests = fresh_requests(synthetic(20, seed=62))
        async with WireClient(gw.endpoint("pccw")) as agent:
            first = await agent.infer(requests)
            await wait_for(lambda: gw.cpu is not None and gw.cpu.restarts >= 1)
            second = await agent.infer(fresh_requests(synthetic(20, seed=63)))
        assert gw.cpu.pids() != [victim]
        restarts = gw.metrics.registry.get_sample_value("hkgw_cpu_worker_restarts_total")
    assert {r.status for r in first} <= {pb.STATUS_OK, pb.STATUS_UNAVAILABLE}
    assert all(r.retry_after_ms > 0 for r in first if r.status == pb.STATUS_UNAVAILABLE)
    assert all(r.status == pb.STATUS_OK for r in second)
    assert restarts is not None
    assert restarts >= 1


def hang() -> None:
    """A CPU task that never finishes on its own (a decoder spinning on a pathological input)."""
    threading.Event().wait()


async def test_a_hung_task_fails_its_batch_for_good_and_gives_its_slot_back() -> None:
    """A task past [cpu] task_timeout_s becomes a non-retryable INTERNAL error (the same batch would hang
    the next worker too), counted in hkgw_cpu_task_timeouts_total; its arena slot is free again and the
    replaced worker serves the next batch."""
    metrics = GatewayMetrics(())
    stage = _stage(metrics, arena_slots=2, task_timeout_s=0.3)
    stage.start()
    try:
        assert stage.arena is not None
        slot = stage.arena.borrow()
        assert slot is not None
        with pytest.raises(BackendError) as raised:
            await asyncio.wait_for(stage._in_worker(hang, lent=slot), timeout=10)
        assert raised.value.status == "INTERNAL"
        assert not raised.value.retryable
        assert "task_timeout_s" in str(raised.value)
        assert stage.arena.free == 2
        assert metrics.registry.get_sample_value("hkgw_cpu_task_timeouts_total") == 1
        prepared = await stage.prepare(
            "ranking", demo_spec("rank-mlp"), _requests(4, pb.REQUEST_KIND_RANKING, seed=75)
        )
        assert prepared.kept == [0, 1, 2, 3]
        stage.release(prepared)
    finally:
        stage.close()


def _stage(metrics: GatewayMetrics | None = None, **kwargs: Any) -> CpuStage:
    return CpuStage(1, "process", metrics or GatewayMetrics(()), inline_max_requests=0, **kwargs)


def _requests(n: int, kind: int, seed: int) -> list[pb.InferRequest]:
    return list(synthetic(n, seed=seed, kind=kind))


async def test_tensors_through_the_arena_equal_those_through_the_pipe() -> None:
    """Prepared tensors read from shared memory equal the same batch returned through the pipe; the slot
    is lent for the backend call and back afterwards."""
    spec = demo_spec("rank-mlp")
    requests = _requests(16, pb.REQUEST_KIND_RANKING, seed=71)
    piped, shared = _stage(arena_slots=0), _stage(arena_slots=2)
    for stage in (piped, shared):
        stage.start()
    try:
        expected = await piped.prepare(spec.pipeline, spec, requests)
        got = await shared.prepare(spec.pipeline, spec, requests)
        assert shared.arena is not None
        assert got.slot is not None
        assert shared.arena.free == 1
        assert expected.slot is None
        assert expected.placed == {}
        assert set(got.inputs) == set(expected.inputs)
        for name, array in expected.inputs.items():
            np.testing.assert_array_equal(got.inputs[name], array)
        shared.release(got)
        assert shared.arena.free == 2
        assert got.inputs == {}
    finally:
        piped.close()
        shared.close()


async def test_a_batch_too_large_for_a_slot_comes_through_the_pipe_and_is_counted() -> None:
    """Tensors bigger than a slot travel the ordinary way, whole, and the fallback is counted."""
    spec = demo_spec("rank-mlp")
    requests = _requests(16, pb.REQUEST_KIND_RANKING, seed=72)
    metrics = GatewayMetrics(())
    stage = _stage(metrics, arena_slots=2, arena_slot_bytes=4096)
    stage.start()
    try:
        got = await stage.prepare(spec.pipeline, spec, requests)
        assert stage.arena is not None
        assert got.slot is None
        assert stage.arena.free == 2
        assert got.inputs[spec.inputs[0].name].nbytes > 4096
        count = metrics.registry.get_sample_value("hkgw_cpu_arena_fallbacks_total", {"reason": "too_large"})
        assert count == 1
    finally:
        stage.close()


async def test_a_cancelled_prepare_keeps_its_slot_until_the_worker_has_finished_writing() -> None:
    """Cancelling the await does not stop a running worker: its slot stays lent until the worker is done."""
    spec = demo_spec("image-classifier")
    ramp = np.linspace(0, 255, 3000, dtype=np.uint8)
    jpeg = io.BytesIO()
    Image.fromarray(np.stack([np.tile(ramp, (3000, 1))] * 3, axis=-1)).save(jpeg, "JPEG", quality=90)
    request = pb.InferRequest(
        model_name="image-classifier",
        kind=pb.REQUEST_KIND_IMAGE,
        image=pb.ImageInput(data=jpeg.getvalue(), format=pb.IMAGE_FORMAT_JPEG, width=3000, height=3000),
    )
    requests = [request] * 12  # 9-megapixel decodes: about a second of work
    stage = _stage(arena_slots=1)
    stage.start()
    try:
        await stage.warm_up()
        task = asyncio.create_task(stage.prepare(spec.pipeline, spec, requests))
        await wait_for(lambda: stage.busy_workers() == 1, what="the worker has the batch")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert stage.arena is not None
        assert stage.arena.free == 0
        assert stage.busy_workers() == 1  # still decoding: the slot stays lent
        await wait_for(lambda: stage.arena is not None and stage.arena.free == 1, timeout_s=30)
        assert stage.busy_workers() == 0
    finally:
        stage.close()


def test_arena_places_fitting_tensors_and_refuses_the_rest() -> None:
    """A worker writes aligned tensors into its slot; too large or object tensors are not written."""
    arena = FeatureArena(slots=2, slot_bytes=1024)
    try:
        slot = arena.borrow()
        assert slot is not None
        assert slot.index == 0
        inputs = {"a": np.arange(10, dtype=np.float32), "b": np.arange(6, dtype=np.int64).reshape(2, 3)}
        placed = place(slot, inputs)
        assert placed is not None
        assert all(offset % ALIGN == 0 for offset, _, _ in placed.values())
        views = arena.views(placed)
        for name, array in inputs.items():
            np.testing.assert_array_equal(views[name], array)
        assert place(slot, {"big": np.zeros(300, dtype=np.float32)}) is None
        assert place(slot, {"o": np.array([b"x"], dtype=object)}) is None
        second = arena.borrow()
        assert second is not None
        assert arena.borrow() is None
        arena.give_back(slot)
        assert arena.free == 1
        del views
    finally:
        arena.close()
        arena.close()


@pytest.mark.parametrize(("free_mb", "slots"), [(1024, 8), (64, 4), (20, 0)])
async def test_the_arena_fits_in_the_room_dev_shm_has(
    monkeypatch: pytest.MonkeyPatch, free_mb: int, slots: int
) -> None:
    """A small /dev/shm (a container's 64 MiB) gets a smaller arena; one too small for two slots gets
    none, and batches still come back whole through the pipe."""
    monkeypatch.setattr(cpu_module, "shm_free_bytes", lambda: free_mb << 20)
    spec = demo_spec("rank-mlp")
    requests = _requests(16, pb.REQUEST_KIND_RANKING, seed=75)
    stage = _stage(arena_slots=8, arena_slot_bytes=8 << 20)
    stage.start()
    try:
        assert (stage.arena.slots if stage.arena is not None else 0) == slots
        prepared = await stage.prepare(spec.pipeline, spec, requests)
        assert (prepared.slot is not None) == (slots > 0)
        assert prepared.inputs[spec.inputs[0].name].shape[0] > 16
        stage.release(prepared)
    finally:
        stage.close()


def _tensor_requests(n: int) -> list[pb.InferRequest]:
    rng = np.random.default_rng(5)
    return [
        pb.InferRequest(
            model_name="vision",
            kind=pb.REQUEST_KIND_TENSOR,
            inputs=[tensor_from_array("pixels", rng.standard_normal((1, 3, 64, 64)).astype(np.float16))],
        )
        for _ in range(n)
    ]


async def test_each_batch_runs_where_it_costs_least(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor batches (bytes moved, nothing computed) stay on the event loop at any size, with no arena
    slot and no worker, unless the model has BYTES tensors; small batches of the cheap pipelines stay on
    the loop too; small image batches go to the local thread; larger batches of the others go to a worker
    through the arena."""
    ran: list[tuple[str, str]] = []
    original = worker_module.prepare_requests

    def recording(
        pipeline: str, spec: ModelSpec, requests: Sequence[pb.InferRequest], payloads: Any = None
    ) -> Prepared:
        ran.append((pipeline, threading.current_thread().name))
        return original(pipeline, spec, requests, payloads)

    monkeypatch.setattr(worker_module, "prepare_requests", recording)
    vision = ModelSpec(
        "vision",
        "1",
        (TensorSpec("pixels", "float16", (3, 64, 64)),),
        (TensorSpec("y", "float32", (2,)),),
        128,
        "tensor",
    )
    tensors = _tensor_requests(40)  # 40 x 24 KiB: past inline_max_requests and ON_LOOP_MAX_BYTES
    assert sum(r.ByteSize() for r in tensors) > cpu_module.ON_LOOP_MAX_BYTES
    stage = CpuStage(1, "process", GatewayMetrics(()), inline_max_requests=4, arena_slots=2)
    stage.start()
    try:
        prepared = await stage.prepare("tensor", vision, tensors)
        assert ran == [("tensor", "MainThread")]
        assert prepared.slot is None and stage.arena is not None and stage.arena.free == 2
        expected = np.concatenate([np.frombuffer(r.inputs[0].raw_data, "<f2") for r in tensors])
        np.testing.assert_array_equal(prepared.inputs["pixels"].reshape(-1), expected)

        ran.clear()
        small = await stage.prepare(
            "ranking", demo_spec("rank-mlp"), _requests(2, pb.REQUEST_KIND_RANKING, 3)
        )
        image = demo_spec("image-classifier")
        await stage.prepare(image.pipeline, image, _requests(2, pb.REQUEST_KIND_IMAGE, 3))
        assert ran[0] == ("ranking", "MainThread") and small.slot is None
        assert ran[1][0] == "image" and ran[1][1].startswith("hkgw-cpu-inline")

        ran.clear()  # a model with a BYTES input: decoded element by element, so not on the loop
        strings = ModelSpec("names", "1", (TensorSpec("s", "object", (1,)),), vision.outputs, 128, "tensor")
        named = [
            pb.InferRequest(
                model_name="names", inputs=[tensor_from_array("s", np.array([[b"a"]], dtype=object))]
            )
        ] * 6
        assert len((await stage.prepare("tensor", strings, named)).kept) == 6
        assert ran == []
        await stage.prepare("tensor", strings, named[:2])  # small: the local thread, still not the loop
        assert ran[0][0] == "tensor" and ran[0][1].startswith("hkgw-cpu-inline")
        ran.clear()

        large = await stage.prepare(
            "ranking", demo_spec("rank-mlp"), _requests(16, pb.REQUEST_KIND_RANKING, 3)
        )
        assert ran == [] and large.slot is not None  # a worker wrote it into the arena
        stage.release(large)

        # finish runs where prepare did, decided once: on the loop for the small ranking batch (whose
        # wire size, given as payloads, decides instead of each request's ByteSize), in a worker for the
        # large one
        ranked = _requests(2, pb.REQUEST_KIND_RANKING, 3)
        on_loop = await stage.prepare(
            "ranking", demo_spec("rank-mlp"), ranked, payloads=[r.SerializeToString() for r in ranked]
        )
        assert on_loop.where == "loop" and small.where == "loop" and large.where is None
        finished: list[str] = []
        finish = worker_module.finish_batch

        def recording_finish(pipeline: str, prepared: Prepared, outputs: Any) -> list[bytes]:
            finished.append(threading.current_thread().name)
            return finish(pipeline, prepared, outputs)

        monkeypatch.setattr(worker_module, "finish_batch", recording_finish)
        scores = {"scores": np.zeros(sum(r.stop - r.start for r in on_loop.rows), dtype=np.float32)}
        answers = await stage.finish("ranking", on_loop, scores, ranked)
        assert finished == ["MainThread"] and len(answers) == 2
        too_big = [b"x" * (cpu_module.ON_LOOP_MAX_BYTES + 1)]  # what the frame says, not ByteSize
        assert stage._local("ranking", ranked[:1], demo_spec("rank-mlp"), size=len(too_big[0])) == "thread"
    finally:
        stage.close()
