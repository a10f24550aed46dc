"""Wire tensors <-> numpy, and the generic tensor pipeline, also end to end on ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgewire import pb
from inference.backends.base import ModelSpec, TensorSpec
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.models import write_demo_repository
from inference.pipeline import tensor as tensor_module
from inference.pipeline.tensor import (
    InvalidInput,
    TensorDecodeError,
    TensorPipeline,
    array_from_tensor,
    decode_bytes,
    encode_bytes,
    tensor_from_array,
)
from tests.gateway.backends.serving import serve

SPEC = ModelSpec(
    name="m",
    version="1",
    inputs=(TensorSpec("x", "float32", (4,)), TensorSpec("ids", "int64", (-1,))),
    outputs=(TensorSpec("y", "float32", (2,)),),
    max_batch_size=8,
    pipeline="tensor",
)


def tensor_request(*tensors: pb.Tensor) -> pb.InferRequest:
    return pb.InferRequest(model_name="m", kind=pb.REQUEST_KIND_TENSOR, inputs=tensors)


def good_request(rows: int, width: int = 3, seed: int = 0) -> pb.InferRequest:
    rng = np.random.default_rng(seed)
    return tensor_request(
        tensor_from_array("x", rng.random((rows, 4), dtype=np.float32)),
        tensor_from_array("ids", rng.integers(0, 100, (rows, width))),
    )


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [
        ("bool", pb.DATA_TYPE_BOOL),
        ("uint8", pb.DATA_TYPE_UINT8),
        ("int8", pb.DATA_TYPE_INT8),
        ("int32", pb.DATA_TYPE_INT32),
        ("int64", pb.DATA_TYPE_INT64),
        ("float16", pb.DATA_TYPE_FP16),
        ("float32", pb.DATA_TYPE_FP32),
        ("float64", pb.DATA_TYPE_FP64),
        ("uint64", pb.DATA_TYPE_UINT64),
    ],
)
def test_every_numeric_dtype_round_trips(dtype: str, datatype: int) -> None:
    """Each numeric dtype maps to its DataType and back with the same values and shape."""
    array = (np.arange(6) % 2 if dtype == "bool" else np.arange(6)).astype(dtype).reshape(2, 3)
    tensor = tensor_from_array("t", array)
    assert (tensor.datatype, list(tensor.shape)) == (datatype, [2, 3])
    back = array_from_tensor(tensor)
    assert back.dtype == array.dtype
    np.testing.assert_array_equal(back, array)


def test_raw_data_is_little_endian_row_major() -> None:
    """INT32 [[1, 2]] is the bytes 01 00 00 00 02 00 00 00, whatever the array's byte order."""
    tensor = tensor_from_array("t", np.array([[1, 2]], dtype=">i4"))
    assert tensor.raw_data == b"\x01\x00\x00\x00\x02\x00\x00\x00"


@given(
    hnp.arrays(st.sampled_from([np.float32, np.int64, np.uint8]), hnp.array_shapes(min_dims=0, max_dims=3))
)
def test_arrays_round_trip(array: np.ndarray) -> None:
    """Any array of a wire dtype survives tensor_from_array -> array_from_tensor."""
    np.testing.assert_array_equal(array_from_tensor(tensor_from_array("t", array)), array)


def test_bytes_use_kserve_length_prefixes() -> None:
    """BYTES elements are a 4-byte little-endian length, then the bytes; decoding inverts it."""
    raw = encode_bytes([b"ab", b""])
    assert raw == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    assert decode_bytes(raw, 2) == [b"ab", b""]
    tensor = tensor_from_array("s", np.array([b"x", "y"], dtype=object))
    assert (tensor.datatype, array_from_tensor(tensor).tolist()) == (pb.DATA_TYPE_BYTES, [b"x", b"y"])


@pytest.mark.parametrize(
    ("raw", "count"),
    [(b"\x05\x00\x00\x00ab", 1), (b"\x01\x00", 1), (b"\x01\x00\x00\x00ab", 1), (b"", 1)],
    ids=["element_past_end", "short_length", "bytes_left_over", "missing_element"],
)
def test_malformed_bytes_are_refused(raw: bytes, count: int) -> None:
    """BYTES data that does not hold exactly count elements is a TensorDecodeError."""
    with pytest.raises(TensorDecodeError):
        decode_bytes(raw, count)


def test_raw_data_of_the_wrong_length_is_refused() -> None:
    """raw_data shorter than the shape needs is a TensorDecodeError."""
    tensor = pb.Tensor(name="t", datatype=pb.DATA_TYPE_FP32, shape=[2, 2], raw_data=b"\x00" * 12)
    with pytest.raises(TensorDecodeError, match="needs 16"):
        array_from_tensor(tensor)


def test_requests_are_stacked_along_the_batch_dim() -> None:
    """Requests of 2 and 3 rows make a 5-row batch; rows[i] are each request's rows."""
    requests = [good_request(2, seed=1), good_request(3, seed=2)]
    prepared = TensorPipeline().prepare(requests, SPEC)
    assert prepared.inputs["x"].shape == (5, 4)
    assert prepared.inputs["ids"].shape == (5, 3)
    assert [(s.start, s.stop) for s in prepared.rows] == [(0, 2), (2, 5)]
    np.testing.assert_array_equal(prepared.inputs["x"][2:], array_from_tensor(requests[1].inputs[0]))


def test_outputs_go_back_to_their_requests() -> None:
    """finish hands each request its own rows of every output."""
    requests = [good_request(2), good_request(1)]
    pipeline = TensorPipeline()
    prepared = pipeline.prepare(requests, SPEC)
    y = np.arange(6, dtype=np.float32).reshape(3, 2)
    results = pipeline.finish(prepared, {"y": y})
    assert [[array_from_tensor(t).tolist() for t in r] for r in results] == [[[[0, 1], [2, 3]]], [[[4, 5]]]]


def test_bad_requests_are_rejected_and_the_rest_served() -> None:
    """Missing inputs, wrong dtypes, wrong dims, short raw_data and ragged dims each get their label."""
    x = tensor_from_array("x", np.ones((1, 4), np.float32))
    ids = tensor_from_array("ids", np.ones((1, 3), np.int64))
    requests = [
        good_request(1),
        tensor_request(x),
        tensor_request(tensor_from_array("x", np.ones((1, 4))), ids),
        tensor_request(tensor_from_array("x", np.ones((1, 5), np.float32)), ids),
        tensor_request(pb.Tensor(name="x", datatype=pb.DATA_TYPE_FP32, shape=[1, 4], raw_data=b"12"), ids),
        tensor_request(x, tensor_from_array("ids", np.ones((1, 7), np.int64))),
        tensor_request(x, tensor_from_array("ids", np.ones((2, 3), np.int64))),
        good_request(2),
    ]
    prepared = TensorPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 7]
    assert {i: label for i, (label, _) in prepared.rejected.items()} == {
        1: InvalidInput.MISSING_INPUT,
        2: InvalidInput.BAD_TENSOR,
        3: InvalidInput.BAD_TENSOR,
        4: InvalidInput.BAD_TENSOR,
        5: InvalidInput.RAGGED_BATCH,
        6: InvalidInput.BAD_TENSOR,
    }


async def test_tensor_requests_run_on_onnx_runtime(tmp_path: Path) -> None:
    """KServe-style features for rank-mlp, sent through the tensor pipeline, come back as scores."""
    write_demo_repository(tmp_path)
    config = tmp_path / "rank-mlp" / "config.pbtxt"
    config.write_text(config.read_text().replace('string_value: "ranking"', 'string_value: "tensor"'))
    backend = OnnxBackend("cpu", OnnxOptions(repository=tmp_path, rescan_interval_s=0))
    await backend.start()
    try:
        rng = np.random.default_rng(0)
        requests = [
            pb.InferRequest(
                model_name="rank-mlp",
                inputs=[
                    tensor_from_array("features", rng.random((n, 40), np.float32)),
                    tensor_from_array("item_rows", np.arange(n, dtype=np.int64).reshape(n, 1)),
                ],
            )
            for n in (3, 5)
        ]
        _, outputs, _ = await serve(backend, requests)
        assert [[(t.name, list(t.shape)) for t in r] for r in outputs] == [
            [("scores", [3, 1])],
            [("scores", [5, 1])],
        ]
    finally:
        await backend.aclose()


def test_a_tensor_of_another_wire_type_is_refused_before_it_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A BYTES tensor where the model takes FP32 is refused without walking its elements."""
    decoded: list[int] = []
    monkeypatch.setattr(tensor_module, "decode_bytes", lambda raw, count: decoded.append(count) or [])
    strings = pb.Tensor(name="x", datatype=pb.DATA_TYPE_BYTES, shape=[1, 4], raw_data=encode_bytes([b""] * 4))
    request = tensor_request(strings, tensor_from_array("ids", np.zeros((1, 3), dtype=np.int64)))
    prepared = TensorPipeline().prepare([request, good_request(1)], SPEC)
    assert prepared.kept == [1]
    label, detail = prepared.rejected[0]
    assert label == InvalidInput.BAD_TENSOR and "where the model takes float32" in detail
    assert decoded == []


def test_a_shape_too_large_to_count_is_refused_alone() -> None:
    """A shape whose element count overflows 64 bits is that request's bad_tensor, not the batch's error."""
    huge = pb.Tensor(name="x", datatype=pb.DATA_TYPE_FP32, shape=[2**32, 2**32, 4], raw_data=b"")
    request = tensor_request(huge, tensor_from_array("ids", np.zeros((1, 3), dtype=np.int64)))
    prepared = TensorPipeline().prepare([request, good_request(1)], SPEC)
    assert prepared.kept == [1]
    assert prepared.rejected[0][0] == InvalidInput.BAD_TENSOR


def test_a_shape_of_more_dims_than_numpy_takes_is_refused_alone() -> None:
    """A tensor of 65 dims whose bytes match its element count is that request's bad_tensor (numpy takes
    at most 64 dims), never an error of the batch; the same shape is refused by array_from_tensor too."""
    shape = [1] * 64 + [4]
    deep = pb.Tensor(name="x", datatype=pb.DATA_TYPE_FP32, shape=shape, raw_data=bytes(16))
    request = tensor_request(deep, tensor_from_array("ids", np.zeros((1, 3), dtype=np.int64)))
    prepared = TensorPipeline().prepare([good_request(1), request, good_request(2)], SPEC)
    assert prepared.kept == [0, 2]
    label, detail = prepared.rejected[1]
    assert label == InvalidInput.BAD_TENSOR and "65 dims" in detail
    with pytest.raises(TensorDecodeError, match="65 dims, at most 64"):
        array_from_tensor(deep)


def test_a_batch_of_more_rows_than_the_model_takes_is_kept_whole() -> None:
    """Requests that fit the model's max_batch_size (8) each are all kept though their rows add up to more
    (the dispatcher cuts its backend calls); only a request over the limit on its own is too_large."""
    requests = [good_request(5, seed=1), good_request(5, seed=2), good_request(9, seed=3)]
    prepared = TensorPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 1]
    assert prepared.inputs["x"].shape == (10, 4)
    label, detail = prepared.rejected[2]
    assert label == InvalidInput.TOO_LARGE and detail == "9 rows, the model takes at most 8"
