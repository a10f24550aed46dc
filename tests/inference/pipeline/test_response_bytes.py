"""Answers written as bytes (``output_bytes``, ``output_prefix``, the pipelines' ``finish_bytes``) are,
byte for byte, what protobuf serializes from the ``pb.Tensor`` objects ``finish`` builds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgewire import pb
from inference.backends.base import ModelSpec, TensorSpec
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.models import write_demo_repository
from inference.pipeline import worker
from inference.pipeline.base import Prepared
from inference.pipeline.image import ImagePipeline
from inference.pipeline.ranking import ITEM_IDS, SCORES, TOP_K, RankingPipeline
from inference.pipeline.registry import pipeline_for
from inference.pipeline.tensor import (
    DTYPE_BY_DATATYPE,
    TensorPipeline,
    batch_slices,
    output_bytes,
    output_prefix,
    tensor_from_array,
)
from inference.pipeline.text import EMBEDDING, TextPipeline
from tests.gateway.backends.serving import serve, synthetic

NUMERIC = [d for d in DTYPE_BY_DATATYPE.values() if d.kind != "O"]
# Every wire dtype in either byte order (big-endian ones are converted), bool and bytes included.
DTYPES = [*NUMERIC, *(d.newbyteorder(">") for d in NUMERIC if d.itemsize > 1)]
names = st.text(max_size=20) | st.sampled_from(["", "scores", "item_ids", "embedding", "probs", "label"])
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
big_shapes = hnp.array_shapes(min_dims=1, max_dims=1, min_side=0, max_side=5000)  # multi-byte lengths


def old_response(tensors: Sequence[pb.Tensor]) -> bytes:
    """What the CPU stage sent before it wrote bytes itself."""
    return pb.InferResponse(outputs=tensors).SerializeToString()


def old_answers(pipeline: str, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
    return [old_response(t) for t in pipeline_for(pipeline).finish(prepared, outputs)]


@st.composite
def wire_arrays(draw: st.DrawFn, shape: st.SearchStrategy[tuple[int, ...]] = shapes) -> np.ndarray:
    """An array of any dtype the pipelines emit: numeric (either byte order, maybe not contiguous) or
    BYTES (an object array of ``bytes`` and ``str``)."""
    if draw(st.booleans()) and draw(st.booleans()):
        elements = st.binary(max_size=12) | st.text(max_size=6)
        array = draw(hnp.arrays(np.dtype(object), draw(shape), elements=elements))
    else:
        # every element drawn (no fill value): a constant array hides byte order and element order
        array = draw(hnp.arrays(draw(st.sampled_from(DTYPES)), draw(shape), fill=st.nothing()))
    if array.ndim >= 2 and draw(st.booleans()):
        array = array.T  # Fortran order: tobytes must still give rows
    if array.ndim >= 1 and draw(st.booleans()):
        array = array[::2]  # strided
    return array


@given(name=names, array=wire_arrays())
def test_an_output_is_what_protobuf_serializes(name: str, array: np.ndarray) -> None:
    """``output_bytes`` equals the serialized response of ``tensor_from_array``, for every wire dtype,
    byte order, layout, shape (scalars and 0-length dims included) and name (the empty one included)."""
    assert output_bytes(name, array) == old_response([tensor_from_array(name, array)])


@settings(max_examples=30)
@given(name=names, array=wire_arrays(big_shapes))
def test_a_large_output_is_what_protobuf_serializes(name: str, array: np.ndarray) -> None:
    """Lengths of two and three varint bytes (raw_data over 127 and 16 KiB) come out as protobuf's."""
    assert output_bytes(name, array) == old_response([tensor_from_array(name, array)])


@given(outputs=st.lists(st.tuples(names, wire_arrays()), max_size=4))
def test_outputs_joined_are_the_response(outputs: list[tuple[str, np.ndarray]]) -> None:
    """Several outputs, their entries concatenated, are the response holding them all in that order."""
    joined = b"".join(output_bytes(name, array) for name, array in outputs)
    assert joined == old_response([tensor_from_array(name, array) for name, array in outputs])


@given(
    name=names,
    datatype=st.sampled_from(list(pb.DataType.values())),
    shape=st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-3, 300), max_size=5),
    raw=st.binary(max_size=300),
)
def test_a_prefix_is_what_protobuf_serializes(
    name: str, datatype: pb.DataType.ValueType, shape: list[int], raw: bytes
) -> None:
    """``output_prefix`` + raw_data is protobuf's encoding for any datatype and int64 dims, negative ones
    (ten-byte varints) included, and for an empty raw_data."""
    tensor = pb.Tensor(name=name, datatype=datatype, shape=shape, raw_data=raw)
    assert output_prefix(name, datatype, tuple(shape), len(raw)) + raw == old_response([tensor])


@st.composite
def ranked_batches(draw: st.DrawFn) -> tuple[Prepared, dict[str, np.ndarray]]:
    """A ranking batch as ``prepare`` leaves it for ``finish``, with scores (NaN and ties included)."""
    counts = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    rows = sum(counts)
    top_k = draw(st.lists(st.integers(0, 45), min_size=len(counts), max_size=len(counts)))
    ids = draw(hnp.arrays(np.uint64, rows))
    values = st.floats(width=32) | st.sampled_from([0.5, -1.0])
    scores = draw(hnp.arrays(np.float32, (rows, 1), elements=values))
    prepared = Prepared(
        inputs={},
        kept=list(range(len(counts))),
        rows=batch_slices(counts),
        extras={ITEM_IDS: ids, TOP_K: np.asarray(top_k, dtype=np.int64)},
    )
    return prepared, {SCORES: scores}


@given(batch=ranked_batches())
def test_ranking_answers_are_the_old_bytes(batch: tuple[Prepared, dict[str, np.ndarray]]) -> None:
    """Ranking's ``finish_bytes`` (a lone request's path and a batch's) equals its tensors serialized."""
    prepared, outputs = batch
    assert RankingPipeline().finish_bytes(prepared, outputs) == old_answers("ranking", prepared, outputs)


@given(
    embeddings=hnp.arrays(
        np.float32, st.tuples(st.integers(0, 6), st.integers(0, 70)), elements=st.floats(-1e6, 1e6, width=32)
    ),
    order=st.randoms(use_true_random=False),
)
def test_text_answers_are_the_old_bytes(embeddings: np.ndarray, order: Any) -> None:
    """Text's ``finish_bytes`` equals its tensors serialized, whatever rows the requests hold."""
    rows = [slice(i, i + 1) for i in range(len(embeddings))]
    order.shuffle(rows)
    prepared = Prepared(inputs={}, kept=list(range(len(rows))), rows=rows)
    outputs = {EMBEDDING: embeddings}
    assert TextPipeline().finish_bytes(prepared, outputs) == old_answers("text", prepared, outputs)


@given(
    logits=hnp.arrays(
        np.float32, st.tuples(st.integers(0, 6), st.integers(1, 12)), elements=st.floats(-50, 50, width=32)
    ),
    labelled=st.booleans(),
)
def test_image_answers_are_the_old_bytes(logits: np.ndarray, labelled: bool) -> None:
    """Image's ``finish_bytes`` equals its tensors serialized, with the model's labels or without."""
    classes = logits.shape[1]
    labels = ",".join(f"ça{i}" for i in range(classes)) if labelled else ""
    spec = ModelSpec(
        name="m",
        version="1",
        pipeline="image",
        max_batch_size=8,
        inputs=(TensorSpec("pixels", "float32", (3, 8, 8)),),
        outputs=(TensorSpec("logits", "float32", (classes,)),),
        parameters={"labels": labels},
    )
    rows = [slice(i, i + 1) for i in range(len(logits))]
    prepared = Prepared(inputs={}, kept=list(range(len(rows))), rows=rows, spec=spec)
    outputs = {"logits": logits}
    assert ImagePipeline().finish_bytes(prepared, outputs) == old_answers("image", prepared, outputs)


@given(
    counts=st.lists(st.integers(0, 4), max_size=5),
    dtypes=st.lists(st.sampled_from([*DTYPES, np.dtype(object)]), min_size=1, max_size=3),
    data=st.data(),
)
def test_tensor_answers_are_the_old_bytes(counts: list[int], dtypes: list[np.dtype[Any]], data: Any) -> None:
    """The tensor pipeline's ``finish_bytes`` equals its tensors serialized, each output of any dtype."""
    rows = sum(counts)
    outputs = {
        f"out{i}": data.draw(
            hnp.arrays(dtype, (rows, *data.draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0))))
            if dtype.kind != "O"
            else hnp.arrays(dtype, (rows, 2), elements=st.binary(max_size=5))
        )
        for i, dtype in enumerate(dtypes)
    }
    prepared = Prepared(inputs={}, kept=list(range(len(counts))), rows=batch_slices(counts))
    assert TensorPipeline().finish_bytes(prepared, outputs) == old_answers("tensor", prepared, outputs)


def test_finish_batch_writes_the_bytes_of_a_pipeline_without_finish_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pipeline that only has ``finish`` is still served: its tensors serialized."""

    class TensorsOnly:
        kind = "tensor"

        def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
            return [[tensor_from_array("y", outputs["y"][rows])] for rows in prepared.rows]

    monkeypatch.setattr(worker, "pipeline_for", lambda name: TensorsOnly())
    prepared = Prepared(inputs={}, kept=[0, 1], rows=batch_slices([1, 2]))
    outputs = {"y": np.arange(6, dtype=np.float32).reshape(3, 2)}
    assert worker.finish_batch("tensor", prepared, outputs) == [
        old_response([tensor_from_array("y", outputs["y"][:1])]),
        old_response([tensor_from_array("y", outputs["y"][1:])]),
    ]


def spoil(request: pb.InferRequest) -> None:
    """Make a request its pipeline drops."""
    if request.kind == pb.REQUEST_KIND_RANKING:
        request.ranking.candidate_feature_width += 1
    elif request.kind == pb.REQUEST_KIND_TEXT:
        request.text.text = ""
    else:
        request.image.data = b"not an image"


@pytest.mark.parametrize("model", ["rank-mlp", "text-encoder", "image-classifier"])
async def test_served_batches_are_answered_with_the_old_bytes(tmp_path: Path, model: str) -> None:
    """Real batches of each demo model, served by ONNX Runtime (one malformed request dropped among
    them), get from ``finish_batch`` exactly the bytes their tensors serialize to."""
    write_demo_repository(tmp_path)
    backend = OnnxBackend("cpu", OnnxOptions(repository=tmp_path, rescan_interval_s=0))
    await backend.start()
    try:
        spec = backend.model(model, "")
        assert spec is not None
        for size in (1, 3, 16):
            requests = synthetic(model, size, seed=size)
            if size > 1:
                spoil(requests[1])
            prepared, tensors, result = await serve(backend, requests)
            assert len(prepared.kept) == size - (size > 1)
            answers = worker.finish_batch(spec.pipeline, prepared, result.outputs)
            assert answers == [old_response(t) for t in tensors]
    finally:
        await backend.aclose()
