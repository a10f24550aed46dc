"""Wire tensors go from the ZeroMQ frame to the backend in place: the CPU stage hands the requests' bytes to
the tensor pipeline wherever it runs it, and a lone request reaches the model as a read-only view of the
frame it came in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from edgewire import pb
from gateway.dispatch.cpu import CpuStage
from gateway.ops.metrics import GatewayMetrics
from gateway.testing import WireClient, fresh_requests, run_gateway
from inference.backends.base import InferCall, InferResult, ModelSpec, TensorSpec
from inference.pipeline.tensor import array_from_tensor
from routing.types import Priority
from tests.gateway.daemon.test_batch_isolation import PIXELS, pixel_requests, tensor_serving
from tests.inference.pipeline.received import Loopback, loopback
from tests.inference.pipeline.test_tensor_views import IMAGE, IMAGES, image_request, pixels_of, root_buffer


@pytest.fixture
def wire() -> Iterator[Loopback]:
    yield from loopback()


async def test_a_tensor_batch_on_the_loop_reads_the_frame(wire: Loopback) -> None:
    """Fixed-width tensors run on the event loop: given the payloads, a lone request's input is the frame's
    memory; without them (a reroute), the batch is decoded from the parsed requests as before."""
    stage = CpuStage(1, "process", GatewayMetrics(()))
    got = wire.send([image_request(11)])
    viewed = await stage.prepare("tensor", IMAGES, got.requests, payloads=got.payloads)
    parsed = await stage.prepare("tensor", IMAGES, got.requests)
    assert np.shares_memory(viewed.inputs["images"], got.frame_bytes())
    assert not np.shares_memory(parsed.inputs["images"], got.frame_bytes())
    np.testing.assert_array_equal(viewed.inputs["images"], parsed.inputs["images"])


async def test_a_tensor_batch_on_a_thread_reads_the_frame(wire: Loopback) -> None:
    """A tensor model with a BYTES output runs on the stage's threads: its numeric input is still read in
    place, one copy for a batch of two."""
    spec = ModelSpec(
        "tagger", "1", IMAGES.inputs, (TensorSpec("tags", "object", (1,)),), IMAGES.max_batch_size, "tensor"
    )
    stage = CpuStage(1, "thread", GatewayMetrics(()))
    stage.start()
    try:
        one = wire.send([image_request(12)])
        alone = await stage.prepare("tensor", spec, one.requests, payloads=one.payloads)
        assert np.shares_memory(alone.inputs["images"], one.frame_bytes())
        two = wire.send([image_request(13), image_request(14)])
        pair = await stage.prepare("tensor", spec, two.requests, payloads=two.payloads)
    finally:
        stage.close()
    assert pair.inputs["images"].shape == (2, *IMAGE)
    assert not np.shares_memory(pair.inputs["images"], two.frame_bytes())
    for rows, request in zip(pair.rows, two.requests, strict=True):
        np.testing.assert_array_equal(pair.inputs["images"][rows], pixels_of(request))


async def test_a_lone_tensor_request_reaches_the_model_as_a_view_of_its_frame(models_dir: Path) -> None:
    """Through a real gateway, one TENSOR request per frame: ONNX Runtime is called with the image as a
    read-only view of the received zmq.Frame, and answers what it answers for an owned copy."""
    calls: list[tuple[object, bool, np.ndarray]] = []
    async with (
        run_gateway(models_dir=models_dir, **tensor_serving(max_queue_delay_us=0)) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        backend = gw.pools["cpu"].backend
        real_infer = backend.infer

        async def infer(call: InferCall) -> InferResult:
            pixels = call.inputs["pixels"]
            calls.append((root_buffer(pixels), pixels.flags.writeable, np.array(pixels)))
            return await real_infer(call)

        backend.infer = infer  # type: ignore[method-assign]
        requests = pixel_requests(3, seed=15)
        answers = [(await agent.infer([request]))[0] for request in requests]
        expected = [
            await real_infer(
                InferCall("image-classifier", "", {"pixels": pixels_of_request(r)}, Priority.REALTIME, None)
            )
            for r in requests
        ]
    assert [a.status for a in answers] == [pb.STATUS_OK] * 3, [a.error_message for a in answers]
    assert len(calls) == 3
    for (root, writeable, seen), request, answer, want in zip(
        calls, requests, answers, expected, strict=True
    ):
        assert isinstance(root, zmq.Frame)
        assert not writeable
        np.testing.assert_array_equal(seen, pixels_of_request(request))
        np.testing.assert_allclose(array_from_tensor(answer.outputs[0]), want.outputs["logits"], rtol=1e-6)


def pixels_of_request(request: pb.InferRequest) -> np.ndarray:
    return np.frombuffer(request.inputs[0].raw_data, np.float32).reshape(1, *PIXELS)


async def test_the_answers_do_not_depend_on_reading_in_place(models_dir: Path) -> None:
    """A frame of several TENSOR requests (one copy into the batch) is answered as its requests are when
    sent one per frame (each read in place; new ids, so that no answer comes from the response cache)."""
    async with (
        run_gateway(models_dir=models_dir, **tensor_serving(max_queue_delay_us=0)) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        requests = pixel_requests(4, seed=16)
        together = await agent.infer(requests)
        apart = [await agent.infer([r]) for r in fresh_requests(requests, budget_s=30)]
    assert [a.status for a in together] == [pb.STATUS_OK] * 4
    for batched, (alone,) in zip(together, apart, strict=True):
        assert alone.status == pb.STATUS_OK
        np.testing.assert_allclose(
            array_from_tensor(batched.outputs[0]), array_from_tensor(alone.outputs[0]), rtol=1e-5
        )
