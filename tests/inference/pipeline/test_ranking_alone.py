"""The ranking pipeline's fast paths give, bit for bit, what its general path gives: a lone request's
prepare and finish, whole-row normalisation against each block's DenseNorm, the item hash."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from inference.backends.base import ModelSpec
from inference.pipeline import ranking
from inference.pipeline.base import Prepared
from inference.pipeline.ranking import (
    RankingLayout,
    RankingPipeline,
    item_rows,
    prepare_alone,
    prepare_batch,
    top_k_order,
    top_k_orders,
)
from tests.gateway.backends.serving import synthetic
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("rank-mlp")
SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45, 1e9, -1e9, 3.4e38, -3.4e38, 0.5, 7.25]
finite32 = st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=False, allow_infinity=False))


def with_parameters(**changes: str | None) -> ModelSpec:
    """The demo ranking spec with some parameters set (None: removed)."""
    parameters = {k: v for k, v in SPEC.parameters.items() if changes.get(k, "") is not None}
    parameters.update({k: v for k, v in changes.items() if v is not None})
    return dataclasses.replace(SPEC, parameters=parameters)


SPECS = {
    "demo": SPEC,
    "clip 0": with_parameters(dense_clip="0"),
    "clip -0": with_parameters(dense_clip="-0"),
    "clip -3": with_parameters(dense_clip="-3"),
    "clip 0.001": with_parameters(dense_clip="0.001"),
    "candidate norm only": with_parameters(user_log1p=None, user_mean=None, user_std=None),
    "no norm": with_parameters(
        user_log1p=None,
        user_mean=None,
        user_std=None,
        candidate_log1p=None,
        candidate_mean=None,
        candidate_std=None,
    ),
    "every column log1p": with_parameters(candidate_log1p="0,1,2,3,4,5,6,7"),
    "no log1p": with_parameters(candidate_log1p=None, user_log1p=None),
}


@st.composite
def ranking_requests(draw: st.DrawFn, finite: bool = True, most: int = 40) -> pb.InferRequest:
    """One ranking request of the demo model's widths (1 to ``most`` candidates), with awkward feature
    values and top_k."""
    n = draw(st.integers(1, most))
    values = finite32 if finite else st.one_of(finite32, st.sampled_from([math.nan, math.inf, -math.inf]))
    return pb.InferRequest(
        model_name="rank-mlp",
        kind=pb.REQUEST_KIND_RANKING,
        ranking=pb.RankingFeatures(
            candidate_item_ids=draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
            candidate_feature_width=8,
            candidate_dense=draw(st.lists(values, min_size=8 * n, max_size=8 * n)),
            user_dense=draw(st.lists(values, min_size=16, max_size=16)),
            categorical_tags=draw(st.lists(st.sampled_from(["a", "b:1", "cat:x", "éü", ""]), max_size=8)),
            top_k=draw(st.integers(0, 45)),
        ),
    )


def assert_same(fast: Prepared, general: Prepared) -> None:
    """Two prepared batches are equal, array bytes and dtypes included."""
    assert (fast.kept, fast.rows, fast.rejected) == (general.kept, general.rows, general.rejected)
    assert (fast.real_elements, fast.padded_elements) == (general.real_elements, general.padded_elements)
    for mine, theirs in ((fast.inputs, general.inputs), (fast.extras, general.extras)):
        assert mine.keys() == theirs.keys()
        for name, array in mine.items():
            assert (array.dtype, array.shape) == (theirs[name].dtype, theirs[name].shape)
            assert array.tobytes() == theirs[name].tobytes(), name


def serialized(results: list[list[pb.Tensor]]) -> list[list[bytes]]:
    return [[t.SerializeToString() for t in tensors] for tensors in results]


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=40, deadline=None)
@given(request=ranking_requests())
def test_a_lone_request_is_prepared_as_in_a_batch_of_one(name: str, request: pb.InferRequest) -> None:
    """prepare_alone gives prepare_batch's batch of one, bit for bit, for every kind of norm and clip."""
    layout = RankingLayout.of(SPECS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clip 0.001 and the like: no overflow, but say nothing either way
        fast = prepare_alone(request, layout)
        general = prepare_batch([request], layout)
    assert fast is not None
    assert_same(fast, general)


@settings(max_examples=60, deadline=None)
@given(request=ranking_requests(finite=False))
def test_a_lone_request_with_non_finite_features_goes_the_general_way(request: pb.InferRequest) -> None:
    """A lone request holding NaN or infinity is left to the general path, which refuses it; prepare
    gives the same either way."""
    layout = RankingLayout.of(SPEC)
    general = prepare_batch([request], layout)
    fast = prepare_alone(request, layout)
    if general.kept:
        assert fast is not None
        assert_same(fast, general)
    else:
        assert fast is None
        assert general.rejected[0][0] == "bad_features"
    assert_same(RankingPipeline().prepare([request], SPEC), general)


def test_a_lone_request_the_model_cannot_take_is_refused_as_in_a_batch() -> None:
    """Too many candidates or a wrong width: prepare of one request says why, as the batch does."""
    (request,) = synthetic("rank-mlp", 1)
    request.ranking.candidate_feature_width = 7
    layout = RankingLayout.of(SPEC)
    assert prepare_alone(request, layout) is None
    prepared = RankingPipeline().prepare([request], SPEC)
    assert_same(prepared, prepare_batch([request], layout))
    assert prepared.kept == [] and prepared.rejected[0][0] == "bad_features"


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=25, deadline=None)
@given(requests=st.lists(ranking_requests(most=12), min_size=2, max_size=4), tiled=st.booleans())
def test_whole_row_normalisation_equals_each_blocks_dense_norm(
    name: str, requests: list[pb.InferRequest], tiled: bool
) -> None:
    """Every row of a batch is each block's DenseNorm.apply (the definition) of the request's own values,
    with the constants tiled or broadcast; tags pass unchanged."""
    layout = RankingLayout.of(SPECS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if tiled:
            features = prepare_batch(requests, layout).inputs["features"]
        else:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(ranking, "TILED_ROWS", 0)
                features = prepare_batch(requests, layout).inputs["features"]
        candidate = np.concatenate(
            [np.asarray(r.ranking.candidate_dense, dtype=np.float32).reshape(-1, 8) for r in requests]
        )
        repeats = [len(r.ranking.candidate_item_ids) for r in requests]
        user = np.repeat(
            np.asarray([list(r.ranking.user_dense) for r in requests], dtype=np.float32), repeats, axis=0
        )
        for block, columns, norm in (
            (candidate, slice(0, 8), layout.candidate_norm),
            (user, slice(8, 24), layout.user_norm),
        ):
            want = block if norm is None else norm.apply(block)
            assert features[:, columns].tobytes() == np.ascontiguousarray(want).tobytes()


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(ranking_requests(most=12), min_size=1, max_size=4), position=st.integers(0, 4))
def test_a_request_gets_the_same_rows_alone_and_in_any_batch(
    requests: list[pb.InferRequest], position: int
) -> None:
    """A lone request's features and item rows are its rows of any batch it is in, bit for bit."""
    alone = RankingPipeline().prepare([requests[0]], SPEC)
    batch = [*requests[1:]]
    batch.insert(min(position, len(batch)), requests[0])
    prepared = RankingPipeline().prepare(batch, SPEC)
    rows = prepared.rows[batch.index(requests[0])]
    for name, array in alone.inputs.items():
        assert array.tobytes() == prepared.inputs[name][rows].tobytes()


scores = st.lists(
    st.sampled_from([0.0, -0.0, 0.25, 0.5, 1.0, -1.0, math.inf, -math.inf, math.nan]), min_size=1, max_size=40
)


@given(own=scores, k=st.integers(0, 45))
def test_top_k_of_one_request_equals_the_batch_sort(own: list[float], k: int) -> None:
    """top_k_order (one argsort) chooses what top_k_orders (the batch's lexsort) chooses: ties in
    position order, NaN and -inf together last in position order, top_k 0 = all, top_k past the end."""
    array = np.array(own, dtype=np.float32)
    chosen, lengths = top_k_orders(array, [len(own)], np.array([k], dtype=np.int64))
    assert top_k_order(array, k).tolist() == chosen.tolist()
    assert lengths.tolist() == [len(chosen)]


SIGNALLING_NAN = 0x7F800001
"""The bits of a float32 NaN with the quiet bit clear (a model may write one). numpy's fmax let it through
on short arrays (its scalar loop), so a lone request ranked it after -inf where its batch tied them."""

score_bits = st.lists(
    st.sampled_from(
        [int(b) for b in np.array([0.0, -0.0, 0.5, -1.0, math.inf, -math.inf], np.float32).view(np.uint32)]
        + [0x7FC00000, 0xFFC00000, SIGNALLING_NAN, 0xFF800001]  # quiet and signalling NaNs, either sign
    ),
    min_size=1,
    max_size=40,
)


@given(bits=score_bits, k=st.integers(0, 45))
def test_top_k_of_one_request_equals_the_batch_sort_for_any_nan(bits: list[int], k: int) -> None:
    """Every NaN, signalling ones included, ranks with -inf, in position order, alone as in a batch."""
    array = np.array(bits, dtype=np.uint32).view(np.float32)
    chosen, _ = top_k_orders(array.copy(), [len(bits)], np.array([k], dtype=np.int64))
    assert top_k_order(array.copy(), k).tolist() == chosen.tolist()


def test_a_signalling_nan_ties_with_minus_infinity_alone() -> None:
    array = np.array([SIGNALLING_NAN, 0xFF800000, 0x3F800000], dtype=np.uint32).view(np.float32)
    assert top_k_order(array, 0).tolist() == [2, 0, 1]  # 1.0, then NaN and -inf in position order


@settings(max_examples=40, deadline=None)
@given(request=ranking_requests(), other=ranking_requests(most=12), own=scores, seed=st.integers(0, 2**16))
def test_a_lone_requests_answer_is_its_answer_in_a_batch(
    request: pb.InferRequest, other: pb.InferRequest, own: list[float], seed: int
) -> None:
    """finish of a lone request (the one-sort path) answers what finish of a batch answers it."""
    pipeline = RankingPipeline()
    n = len(request.ranking.candidate_item_ids)
    rng = np.random.default_rng(seed)
    mine = np.resize(np.array(own, dtype=np.float32), n).reshape(n, 1)
    theirs = rng.standard_normal((len(other.ranking.candidate_item_ids), 1)).astype(np.float32)
    alone = pipeline.finish(pipeline.prepare([request], SPEC), {"scores": mine})
    both = pipeline.finish(
        pipeline.prepare([request, other], SPEC), {"scores": np.concatenate([mine, theirs])}
    )
    assert serialized(alone) == serialized(both[:1])


@given(ids=st.lists(st.integers(0, 2**64 - 1), max_size=40), table=st.integers(1, 2**63))
def test_item_rows_equal_the_reference_hash(ids: list[int], table: int) -> None:
    """The in-place SplitMix64 finaliser gives the Python reference's rows, and leaves the ids as they are."""
    mask = (1 << 64) - 1

    def reference(item_id: int) -> int:
        z = (item_id + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return (z ^ (z >> 31)) % table

    array = np.array(ids, dtype=np.uint64)
    rows = item_rows(array, table)
    assert rows.dtype == np.int64
    assert rows.tolist() == [reference(i) for i in ids]
    assert array.tolist() == ids
