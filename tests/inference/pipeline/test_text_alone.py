"""The text pipeline's fast paths give, bit for bit, what its general path gives: a lone request's
input tensors, and the embeddings' norm."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from inference.pipeline.base import Prepared
from inference.pipeline.text import EMBEDDING, TextPipeline
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("text-encoder")
texts = st.text(alphabet=st.sampled_from(list("ab cdé中文,.!?-_xyz ")), max_size=400)


def text_request(text: str) -> pb.InferRequest:
    return pb.InferRequest(model_name="text-encoder", kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery(text=text))


@settings(max_examples=80, deadline=None)
@given(text=texts)
def test_a_lone_text_is_prepared_as_in_a_batch(text: str) -> None:
    """A lone request's input_ids and attention_mask (two slices) equal its row of a batch of two (the
    mask over the batch), dtypes and counts included; an empty one is refused alike."""
    pipeline = TextPipeline()
    alone = pipeline.prepare([text_request(text)], SPEC)
    pair = pipeline.prepare([text_request(text), text_request(text)], SPEC)
    if not alone.kept:
        assert alone.rejected[0][0] == pair.rejected[0][0] == "empty_text"
        return
    assert (alone.kept, alone.rows, alone.truncated) == ([0], [slice(0, 1)], pair.truncated // 2)
    assert (alone.real_elements, alone.padded_elements) == (
        pair.real_elements // 2,
        pair.padded_elements // 2,
    )
    for name, array in alone.inputs.items():
        assert array.dtype == pair.inputs[name].dtype == np.int64
        assert array.tobytes() == pair.inputs[name][:1].tobytes()


@given(
    rows=st.integers(1, 6),
    dim=st.integers(1, 70),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 1e-30, 1e20, 0.0]),
)
def test_embeddings_are_normalised_as_by_linalg_norm(rows: int, dim: int, seed: int, scale: float) -> None:
    """finish divides each embedding by np.linalg.norm's value (floored at 1e-12), bit for bit."""
    embeddings = (np.random.default_rng(seed).standard_normal((rows, dim)) * scale).astype(np.float32)
    prepared = Prepared(inputs={}, kept=list(range(rows)), rows=[slice(i, i + 1) for i in range(rows)])
    with np.errstate(over="ignore", under="ignore"):
        want = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), np.float32(1e-12))
        got = TextPipeline().finish(prepared, {EMBEDDING: embeddings})
    assert [t.raw_data for (t,) in got] == [row.astype("<f4").tobytes() for row in want]
