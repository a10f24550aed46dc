"""Wire tensors read in place: from the ZeroMQ frame into the batch with one copy, none for a batch of one,
and the same checks and reasons as from the parsed requests."""

from __future__ import annotations

import gc
import tracemalloc
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import new_id, pb
from inference.backends.base import ModelSpec, TensorSpec
from inference.pipeline import worker
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import InvalidInput, TensorPipeline, tensor_from_array
from inference.pipeline.tensor_spans import raw_data_views
from tests.inference.pipeline.received import Loopback, loopback

IMAGE = (3, 224, 224)
IMAGES = ModelSpec(
    name="img16",
    version="1",
    inputs=(TensorSpec("images", "float16", IMAGE),),
    outputs=(TensorSpec("logits", "float32", (10,)),),
    max_batch_size=8,
    pipeline="tensor",
)
SPEC = ModelSpec(  # as in test_tensor.py: a fixed and a variable input
    name="m",
    version="1",
    inputs=(TensorSpec("x", "float32", (4,)), TensorSpec("ids", "int64", (-1,))),
    outputs=(TensorSpec("y", "float32", (2,)),),
    max_batch_size=8,
    pipeline="tensor",
)
IMAGE_BYTES = int(np.prod(IMAGE)) * 2  # 301,056


@pytest.fixture
def wire() -> Iterator[Loopback]:
    yield from loopback()


def image_request(seed: int, rows: int = 1) -> pb.InferRequest:
    pixels = np.random.default_rng(seed).standard_normal((rows, *IMAGE)).astype(np.float16)
    return pb.InferRequest(
        request_id=new_id(),
        model_name="img16",
        kind=pb.REQUEST_KIND_TENSOR,
        inputs=[tensor_from_array("images", pixels)],
    )


def pixels_of(request: pb.InferRequest) -> np.ndarray:
    tensor = request.inputs[0]
    return np.frombuffer(tensor.raw_data, np.float16).reshape(tuple(tensor.shape))


def peak_bytes(call: Callable[[], Prepared]) -> tuple[Prepared, int]:
    """What ``call`` returns and the most memory it had allocated at once (Python and numpy)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        result = call()
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def same(a: Prepared, b: Prepared) -> None:
    assert (a.kept, a.rows, a.rejected) == (b.kept, b.rows, b.rejected)
    assert a.inputs.keys() == b.inputs.keys()
    for name, array in a.inputs.items():
        assert array.dtype == b.inputs[name].dtype
        np.testing.assert_array_equal(array, b.inputs[name])


def test_a_batch_of_one_is_a_read_only_view_of_the_frame(wire: Loopback) -> None:
    """One request: its input is the frame's own memory (no copy, nothing allocated), and is read-only."""
    request = image_request(1)
    got = wire.send([request])
    prepared, peak = peak_bytes(lambda: TensorPipeline().prepare_views(got.requests, got.payloads, IMAGES))
    images = prepared.inputs["images"]
    assert images.shape == (1, *IMAGE)
    assert np.shares_memory(images, got.frame_bytes())
    assert peak < IMAGE_BYTES // 10
    np.testing.assert_array_equal(images, pixels_of(request))
    assert not images.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        images[0, 0, 0, 0] = 1


def test_a_batch_is_copied_once_from_the_frame(wire: Loopback) -> None:
    """Three requests: one allocation of the batch's size (the rows copied into it from the frame), where
    reading the parsed requests allocates twice that (raw_data copied out, then stacked)."""
    requests = [image_request(seed) for seed in (2, 3, 4)]
    got = wire.send(requests)
    pipeline = TensorPipeline()
    prepared, peak = peak_bytes(lambda: pipeline.prepare_views(got.requests, got.payloads, IMAGES))
    parsed, parsed_peak = peak_bytes(lambda: pipeline.prepare(got.requests, IMAGES))
    images = prepared.inputs["images"]
    assert images.nbytes == 3 * IMAGE_BYTES
    assert images.nbytes <= peak < 1.1 * images.nbytes
    assert parsed_peak > 1.9 * images.nbytes
    assert not np.shares_memory(images, got.frame_bytes())
    assert images.flags.writeable and images.flags.owndata
    for rows, request in zip(prepared.rows, requests, strict=True):
        np.testing.assert_array_equal(images[rows], pixels_of(request))
    same(prepared, parsed)


def root_buffer(array: np.ndarray) -> object:
    """What an array's memory finally belongs to, through its bases and memoryviews."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_the_view_keeps_the_frame_alive_until_the_batch_is_dropped(wire: Loopback) -> None:
    """The batch of one holds the zmq.Frame it reads: the frame outlives everything else that referred to
    it and goes when the batch does."""
    request = image_request(5)
    got = wire.send([request])
    prepared = TensorPipeline().prepare_views(got.requests, got.payloads, IMAGES)
    assert isinstance(root_buffer(prepared.inputs["images"]), zmq.Frame)
    frame = weakref.ref(got.frame)
    del got
    gc.collect()
    assert frame() is not None
    np.testing.assert_array_equal(prepared.inputs["images"], pixels_of(request))
    del prepared
    gc.collect()
    assert frame() is None


def test_payloads_reach_the_pipeline_through_prepare_requests(wire: Loopback) -> None:
    """worker.prepare_requests reads the payloads in place when given them, the parsed requests when not."""
    got = wire.send([image_request(6)])
    viewed = worker.prepare_requests("tensor", IMAGES, got.requests, got.payloads)
    parsed = worker.prepare_requests("tensor", IMAGES, got.requests)
    assert np.shares_memory(viewed.inputs["images"], got.frame_bytes())
    assert not np.shares_memory(parsed.inputs["images"], got.frame_bytes())
    assert viewed.spec is IMAGES
    same(viewed, parsed)


def test_a_worker_batch_reads_its_payload_bytes_in_place() -> None:
    """prepare_batch (a worker's entry, requests as bytes) gives the same batch, its input a view of them."""
    payload = image_request(7).SerializeToString()
    prepared = worker.prepare_batch("tensor", IMAGES, [payload])
    assert np.shares_memory(prepared.inputs["images"], np.frombuffer(payload, np.uint8))
    same(prepared, worker.prepare_requests("tensor", IMAGES, [pb.InferRequest.FromString(payload)]))


def x_ids(
    rows: int = 1, x_width: int = 4, ids: tuple[int, int] = (1, 3), x_dtype: str = "float32"
) -> list[pb.Tensor]:
    return [
        tensor_from_array("x", np.ones((rows, x_width), x_dtype)),
        tensor_from_array("ids", np.ones(ids, np.int64)),
    ]


def test_bad_requests_are_refused_for_the_same_reasons_read_in_place(wire: Loopback) -> None:
    """Missing inputs, wrong dtypes, wrong dims, short raw_data, ragged dims and rows that disagree get
    the labels and details they get from the parsed requests, and the good ones are served."""
    short = pb.Tensor(name="x", datatype=pb.DATA_TYPE_FP32, shape=[1, 4], raw_data=b"12")
    inputs = [
        x_ids(),
        x_ids()[:1],
        x_ids(x_dtype="float64"),
        x_ids(x_width=5),
        [short, x_ids()[1]],
        x_ids(ids=(1, 7)),
        x_ids(ids=(2, 3)),
        [pb.Tensor(name="x", datatype=pb.DATA_TYPE_BF16, shape=[1, 4]), x_ids()[1]],
        [pb.Tensor(name="x", datatype=pb.DATA_TYPE_FP32, shape=[1] * 70), x_ids()[1]],
        x_ids(rows=9, ids=(9, 3)),
        x_ids(rows=2, ids=(2, 3)),
    ]
    requests = [pb.InferRequest(request_id=new_id(), model_name="m", inputs=t) for t in inputs]
    got = wire.send(requests)
    pipeline = TensorPipeline()
    viewed = pipeline.prepare_views(got.requests, got.payloads, SPEC)
    same(viewed, pipeline.prepare(got.requests, SPEC))
    assert viewed.kept == [0, 10]
    assert {i: label for i, (label, _) in viewed.rejected.items()} == {
        1: InvalidInput.MISSING_INPUT,
        2: InvalidInput.BAD_TENSOR,
        3: InvalidInput.BAD_TENSOR,
        4: InvalidInput.BAD_TENSOR,
        5: InvalidInput.RAGGED_BATCH,
        6: InvalidInput.BAD_TENSOR,
        7: InvalidInput.BAD_TENSOR,
        8: InvalidInput.BAD_TENSOR,
        9: InvalidInput.TOO_LARGE,
    }
    assert "needs 16" in viewed.rejected[4][1]


def test_a_model_without_a_batch_dim_takes_one_request_in_place(wire: Loopback) -> None:
    """max_batch_size 0: the first request's tensor is the batch (a view), the next one is ragged_batch."""
    spec = ModelSpec("one", "1", (TensorSpec("images", "float16", IMAGE),), (), 0, "tensor")
    unbatched = pb.InferRequest(
        request_id=new_id(), inputs=[tensor_from_array("images", pixels_of(image_request(8))[0])]
    )
    got = wire.send([unbatched, unbatched])
    prepared = TensorPipeline().prepare_views(got.requests, got.payloads, spec)
    assert prepared.inputs["images"].shape == IMAGE
    assert np.shares_memory(prepared.inputs["images"], got.frame_bytes())
    assert prepared.rejected == {1: (InvalidInput.RAGGED_BATCH, "model one does not batch")}


def request_bytes(*tensors: bytes, request_id: bytes) -> bytes:
    """An InferRequest encoded by hand: its id, then each input as given (field 8)."""
    out = b"\x0a\x10" + request_id
    for tensor in tensors:
        out += b"\x42" + varint(len(tensor)) + tensor
    return out


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_fields_written_twice_or_in_pieces_read_as_protobuf_reads_them() -> None:
    """A second raw_data replaces the first, a shape in pieces (packed, then unpacked) adds up, a field of
    the wrong wire type is unknown: the views are what the parsed request holds."""
    first, second = np.zeros((1, 4), np.float32), np.arange(4, dtype=np.float32).reshape(1, 4)
    x = (
        b"\x0a\x01x\x10\x07"  # name "x", datatype FP32
        + b"\x1a\x01\x01"  # shape, packed: [1]
        + b"\x22\x10"
        + first.tobytes()
        + b"\x18\x04"  # shape, unpacked: 4
        + b"\x25\x00\x00\x00\x00"  # field 4 as a fixed32: unknown, not raw_data
        + b"\x22\x10"
        + second.tobytes()
    )
    ids = tensor_from_array("ids", np.ones((1, 2), np.int64)).SerializeToString()
    raw = request_bytes(x, ids, request_id=new_id())
    request = pb.InferRequest.FromString(raw)
    assert list(request.inputs[0].shape) == [1, 4]
    views = raw_data_views(request, raw)
    assert views is not None
    assert [bytes(v) for v in views] == [t.raw_data for t in request.inputs]
    prepared = TensorPipeline().prepare_views([request], [raw], SPEC)
    np.testing.assert_array_equal(prepared.inputs["x"], second)
    assert np.shares_memory(prepared.inputs["x"], np.frombuffer(raw, np.uint8))


@pytest.mark.parametrize(
    "payload_of",
    [
        lambda raw: raw[:-3],  # truncated: the scan refuses it
        lambda raw: b"\xff" * 8,  # not an encoding at all
        lambda raw: b"\x0a\x10" + new_id() + raw[18:],  # another request's id
        lambda raw: raw + raw[18:],  # its inputs twice
        lambda raw: raw.replace(b"\x0a\x01x", b"\x0a\x01z"),  # another input's name
        lambda raw: raw.replace(b"\x10\x07", b"\x10\x08"),  # another datatype
    ],
    ids=["truncated", "garbage", "other_id", "inputs_twice", "other_name", "other_datatype"],
)
def test_a_payload_that_does_not_encode_its_request_is_read_from_the_parsed_one(
    payload_of: Callable[[bytes], bytes],
) -> None:
    """Bytes that are malformed or hold something else than the parsed request are not used: the batch
    is what prepare makes of the parsed request (owned arrays, same outcome)."""
    request = pb.InferRequest(request_id=new_id(), inputs=x_ids(rows=2, ids=(2, 3)))
    raw = request.SerializeToString()
    assert raw.startswith(b"\x0a\x10")
    payload = payload_of(raw)
    assert raw_data_views(request, payload) is None
    pipeline = TensorPipeline()
    prepared = pipeline.prepare_views([request], [payload], SPEC)
    same(prepared, pipeline.prepare([request], SPEC))
    assert all(a.flags.owndata for a in prepared.inputs.values())


def test_payloads_must_match_the_requests_one_for_one() -> None:
    """A payload list of another length is the caller's bug, not a request to drop."""
    request = pb.InferRequest(inputs=x_ids())
    with pytest.raises(ValueError, match="2 payloads for 1 requests"):
        TensorPipeline().prepare_views([request], [b"", b""], SPEC)


@st.composite
def tensor_requests(draw: st.DrawFn) -> pb.InferRequest:
    """Requests for SPEC and UNBATCHED, valid or not (mostly valid): inputs present or not, of the
    model's dtype or another, of its width or not, rows that agree or not, raw_data cut short now and
    then, in any order."""
    rows = draw(st.integers(0, 3))
    tensors = []
    for name, model_dtype, width in (
        ("x", "float32", draw(st.sampled_from([4, 4, 4, 3]))),
        ("ids", "int64", draw(st.integers(1, 3))),
    ):
        if draw(st.integers(0, 9)) == 0:
            continue
        shape = (draw(st.sampled_from([rows, rows, rows, 1])), width)
        dtype = draw(st.sampled_from([model_dtype, model_dtype, model_dtype, "float16"]))
        tensor = tensor_from_array(name, np.ones(shape, dtype))
        if draw(st.integers(0, 9)) == 0:
            tensor.raw_data = tensor.raw_data[:-1]
        tensors.append(tensor)
    return pb.InferRequest(request_id=new_id(), inputs=draw(st.permutations(tensors)))


UNBATCHED = ModelSpec(  # no batch dim: a tensor's shape is the model's dims
    name="u",
    version="1",
    inputs=(TensorSpec("x", "float32", (-1, 4)), TensorSpec("ids", "int64", (1, -1))),
    outputs=(),
    max_batch_size=0,
    pipeline="tensor",
)


@pytest.mark.parametrize("spec", [SPEC, UNBATCHED], ids=["batched", "unbatched"])
@settings(max_examples=100, deadline=None)
@given(requests=st.lists(tensor_requests(), min_size=1, max_size=5))
def test_any_batch_is_the_same_read_in_place_or_from_the_parsed_requests(
    spec: ModelSpec, requests: list[pb.InferRequest]
) -> None:
    """Whatever the requests, valid or not, both ways give the same kept rows, arrays and rejections."""
    payloads = [r.SerializeToString() for r in requests]
    pipeline = TensorPipeline()
    same(pipeline.prepare_views(requests, payloads, spec), pipeline.prepare(requests, spec))
