"""The ranking pipeline: candidate feature rows, top-k by score, rejection of malformed features."""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgewire import pb
from inference.pipeline.ranking import (
    RankingPipeline,
    dense_parts,
    packed_floats32,
    top_k_orders,
)
from inference.pipeline.tensor import InvalidInput
from tests.gateway.backends.serving import synthetic
from tests.inference.pipeline.specs import demo_spec

SPEC = demo_spec("rank-mlp")


def reference_norm(values: list[float], prefix: str) -> list[float]:
    """One block of dense features normalised the obvious way, value by value, from the model's parameters."""
    params = SPEC.parameters
    logged = {int(i) for i in params[f"{prefix}_log1p"].split(",")}
    means = [float(v) for v in params[f"{prefix}_mean"].split(",")]
    stds = [float(v) for v in params[f"{prefix}_std"].split(",")]
    clip = float(params["dense_clip"])
    out = []
    for i, value in enumerate(values):
        x = math.copysign(math.log1p(abs(value)), value) if i in logged else value
        out.append(min(max((x - means[i]) / stds[i], -clip), clip))
    return out


def reference_rows(requests: list[pb.InferRequest]) -> np.ndarray:
    """Feature rows built one candidate at a time, the obvious way."""
    rows = []
    for request in requests:
        r = request.ranking
        tags = [0.0] * 16
        for tag in r.categorical_tags:
            tags[zlib.crc32(tag.encode("utf-8")) % 16] += 1.0
        user = reference_norm(list(r.user_dense), "user")
        for i in range(len(r.candidate_item_ids)):
            rows.append(
                [*reference_norm(list(r.candidate_dense[i * 8 : (i + 1) * 8]), "candidate"), *user, *tags]
            )
    return np.array(rows, dtype=np.float32)


def reference_item_row(item_id: int, table_rows: int) -> int:
    """SplitMix64's finaliser on Python integers, masked to 64 bits."""
    mask = (1 << 64) - 1
    z = (item_id + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) % table_rows


def scored(prepared_rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Model outputs: a random score per row."""
    return {"scores": np.random.default_rng(seed).random((prepared_rows, 1), dtype=np.float32)}


def test_feature_matrix_matches_reference() -> None:
    """The batch's feature matrix equals the per-candidate reference, request after request."""
    requests = synthetic("rank-mlp", 5)
    prepared = RankingPipeline().prepare(requests, SPEC)
    np.testing.assert_allclose(prepared.inputs["features"], reference_rows(requests), rtol=1e-5, atol=1e-6)
    assert prepared.inputs["features"].dtype == np.float32


def test_item_rows_match_reference_hash() -> None:
    """Each candidate's embedding row is the reference SplitMix64 hash of its id modulo the table size."""
    requests = synthetic("rank-mlp", 3)
    requests[0].ranking.candidate_item_ids[0] = (1 << 64) - 1  # the largest id wraps like the reference
    prepared = RankingPipeline().prepare(requests, SPEC)
    table = int(SPEC.parameters["item_table_rows"])
    expected = [reference_item_row(i, table) for r in requests for i in r.ranking.candidate_item_ids]
    assert prepared.inputs["item_rows"].dtype == np.int64
    assert prepared.inputs["item_rows"].reshape(-1).tolist() == expected
    assert len(set(expected)) > len(expected) // 2  # spread over the table, not a few rows


def test_normalisation_clips_outliers() -> None:
    """A price of a billion is log-scaled and clipped to dense_clip standard deviations, never inf or NaN."""
    requests = synthetic("rank-mlp", 1)
    requests[0].ranking.candidate_dense[0] = 1e9
    requests[0].ranking.user_dense[15] = -1e30
    features = RankingPipeline().prepare(requests, SPEC).inputs["features"]
    assert np.isfinite(features).all()
    assert features[0, 0] == pytest.approx(min((math.log1p(1e9) - 3.25) / 0.85, 8.0))
    assert features[0, 8 + 15] == -8.0


def test_the_largest_finite_features_normalise_without_overflow() -> None:
    """Features at float32's limits clip to dense_clip with no overflow along the way (no RuntimeWarning):
    they are clipped before they are standardised."""
    requests = synthetic("rank-mlp", 2)
    biggest = float(np.finfo(np.float32).max)
    requests[0].ranking.candidate_dense[1] = biggest  # a column without log1p, std 0.16
    requests[0].ranking.user_dense[0] = -biggest  # std 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = RankingPipeline().prepare(requests, SPEC)
    features = prepared.inputs["features"]
    assert prepared.kept == [0, 1]
    assert features[0, 1] == 8.0
    assert features[0, 8] == -8.0
    np.testing.assert_allclose(features[prepared.rows[1]], reference_rows(requests[1:]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_request_with_a_nan_or_infinite_feature_is_refused_alone(value: float) -> None:
    """A NaN or an infinity among a request's candidate or user features: that request is bad_features,
    naming the field; the requests around it are served with their own rows and tags."""
    requests = synthetic("rank-mlp", 4)
    requests[1].ranking.candidate_dense[3] = value
    requests[2].ranking.user_dense[0] = value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepared = RankingPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 3]
    assert {i: label for i, (label, _) in prepared.rejected.items()} == {
        1: InvalidInput.BAD_FEATURES,
        2: InvalidInput.BAD_FEATURES,
    }
    assert prepared.rejected[1][1].startswith("candidate_dense holds NaN or infinity")
    assert prepared.rejected[2][1].startswith("user_dense holds NaN or infinity")
    kept = [requests[0], requests[3]]
    np.testing.assert_allclose(prepared.inputs["features"], reference_rows(kept), rtol=1e-5, atol=1e-6)
    sizes = [len(r.ranking.candidate_item_ids) for r in kept]
    assert [(s.start, s.stop) for s in prepared.rows] == [(0, sizes[0]), (sizes[0], sum(sizes))]
    assert prepared.extras["top_k"].tolist() == [r.ranking.top_k for r in kept]


def test_rows_slice_each_requests_candidates() -> None:
    """rows[i] covers exactly the candidates of kept[i], in order."""
    requests = synthetic("rank-mlp", 4)
    prepared = RankingPipeline().prepare(requests, SPEC)
    sizes = [len(r.ranking.candidate_item_ids) for r in requests]
    assert [(s.start, s.stop) for s in prepared.rows] == [
        (sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))
    ]
    assert prepared.real_elements == prepared.padded_elements == sum(sizes) * 40


def test_top_k_items_by_score() -> None:
    """Each request gets its top_k item ids, highest score first, with their scores."""
    requests = synthetic("rank-mlp", 3)
    pipeline = RankingPipeline()
    prepared = pipeline.prepare(requests, SPEC)
    outputs = scored(prepared.inputs["features"].shape[0])
    results = pipeline.finish(prepared, outputs)
    for request, rows, (ids, scores) in zip(requests, prepared.rows, results, strict=True):
        own = outputs["scores"][rows, 0]
        best = np.argsort(-own, kind="stable")[: request.ranking.top_k]
        want_ids = np.asarray(request.ranking.candidate_item_ids, dtype=np.uint64)[best]
        assert (ids.datatype, scores.datatype) == (pb.DATA_TYPE_UINT64, pb.DATA_TYPE_FP32)
        np.testing.assert_array_equal(np.frombuffer(ids.raw_data, dtype="<u8"), want_ids)
        np.testing.assert_array_equal(np.frombuffer(scores.raw_data, dtype="<f4"), own[best])


def test_top_k_zero_returns_every_candidate() -> None:
    """top_k 0 ranks all candidates."""
    (request,) = synthetic("rank-mlp", 1)
    request.ranking.top_k = 0
    pipeline = RankingPipeline()
    prepared = pipeline.prepare([request], SPEC)
    ((ids, _),) = pipeline.finish(prepared, scored(prepared.inputs["features"].shape[0]))
    assert list(ids.shape) == [len(request.ranking.candidate_item_ids)]


def top_k_order(scores: np.ndarray, k: int) -> np.ndarray:
    """One request's top-k positions: the batch sort over a batch of one."""
    chosen, _ = top_k_orders(scores, [len(scores)], np.asarray([k]))
    return chosen


def test_ties_keep_candidate_order() -> None:
    """Equal scores are ranked by position, also across the top-k cut."""
    scores = np.array([0.5, 0.9, 0.5, 0.9, 0.1, 0.5], dtype=np.float32)
    assert top_k_order(scores, 3).tolist() == [1, 3, 0]
    assert top_k_order(scores, 0).tolist() == [1, 3, 0, 2, 5, 4]


@given(
    scores=st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, float("nan")]), min_size=1, max_size=40),
    k=st.integers(0, 45),
)
def test_top_k_order_equals_a_stable_sort(scores: list[float], k: int) -> None:
    """top_k_order equals sorting by (score descending, position), NaN last, cut to k."""
    array = np.array(scores, dtype=np.float32)
    keys = [float("inf") if math.isnan(s) else -s for s in scores]
    want = sorted(range(len(scores)), key=lambda i: (keys[i], i))[: k or len(scores)]
    assert top_k_order(array, k).tolist() == want


@given(
    requests=st.lists(
        st.tuples(
            st.lists(
                st.sampled_from([0.0, 0.25, 0.5, 1.0, float("-inf"), float("nan")]), min_size=1, max_size=30
            ),
            st.integers(0, 35),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_top_k_of_a_whole_batch_equals_each_request_sorted_alone(
    requests: list[tuple[list[float], int]],
) -> None:
    """One sort over the batch gives every request's own top-k: (score descending, position), NaN and
    -inf last in position order, cut to its k; the requests' choices follow one another."""
    scores = np.array([s for own, _ in requests for s in own], dtype=np.float32)
    chosen, lengths = top_k_orders(
        scores, [len(own) for own, _ in requests], np.array([k for _, k in requests])
    )
    start = end = 0
    for (own, k), length in zip(requests, lengths.tolist(), strict=True):
        keys = [math.inf if math.isnan(s) else -s for s in own]
        want = sorted(range(len(own)), key=lambda i: (keys[i], i))[: k or len(own)]
        assert (chosen[end : end + length] - start).tolist() == want
        start, end = start + len(own), end + length
    assert end == len(chosen)


def test_unpacked_and_packed_float_parts_read_alike() -> None:
    """A field read value by value (an array) joins packed bytes in their order."""
    packed = np.array([1.5, -2.0], dtype="<f4").tobytes()
    got = packed_floats32([packed, np.array([3.0], dtype=np.float32), packed])
    assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0, 3.0, 1.5, -2.0]


def break_width(r: pb.RankingFeatures) -> None:
    r.candidate_feature_width = 7


def break_dense_length(r: pb.RankingFeatures) -> None:
    del r.candidate_dense[-1]


def break_user_width(r: pb.RankingFeatures) -> None:
    r.user_dense.append(1.0)


def remove_candidates(r: pb.RankingFeatures) -> None:
    del r.candidate_item_ids[:]
    del r.candidate_dense[:]


@pytest.mark.parametrize("damage", [break_width, break_dense_length, break_user_width, remove_candidates])
def test_bad_features_are_rejected_and_the_rest_served(damage: object) -> None:
    """A request with malformed features is dropped as bad_features; the others keep their rows."""
    requests = synthetic("rank-mlp", 3)
    assert callable(damage)
    damage(requests[1].ranking)
    prepared = RankingPipeline().prepare(requests, SPEC)
    assert prepared.kept == [0, 2]
    assert prepared.rejected[1][0] == InvalidInput.BAD_FEATURES
    expected = reference_rows([requests[0], requests[2]])
    np.testing.assert_allclose(prepared.inputs["features"], expected, rtol=1e-5, atol=1e-6)


def test_all_rejected_gives_an_empty_batch() -> None:
    """A batch with no usable request has zero rows of the right width."""
    requests = synthetic("rank-mlp", 2)
    for request in requests:
        break_width(request.ranking)
    prepared = RankingPipeline().prepare(requests, SPEC)
    assert (prepared.kept, prepared.inputs["features"].shape) == ([], (0, 40))


def test_finish_answers_the_kept_requests_from_prepare_alone() -> None:
    """After a rejection, finish (given no requests) answers the kept ones in order, each with its own
    candidates."""
    requests = synthetic("rank-mlp", 3)
    break_width(requests[0].ranking)
    pipeline = RankingPipeline()
    prepared = pipeline.prepare(requests, SPEC)
    results = pipeline.finish(prepared, scored(prepared.inputs["features"].shape[0]))
    assert prepared.kept == [1, 2] and len(results) == 2
    for index, (ids, _) in zip(prepared.kept, results, strict=True):
        ranking = requests[index].ranking
        got = np.frombuffer(ids.raw_data, dtype="<u8").tolist()
        candidates = len(ranking.candidate_item_ids)
        assert len(got) == min(ranking.top_k or candidates, candidates)
        assert set(got) <= set(ranking.candidate_item_ids)


@given(
    st.lists(st.floats(width=32, allow_nan=False), max_size=64),
    st.lists(st.floats(width=32, allow_nan=False), max_size=16),
)
def test_dense_features_read_from_packed_bytes_equal_the_repeated_fields(
    candidate: list[float], user: list[float]
) -> None:
    """The packed-bytes read gives exactly the values (and count) of the repeated float fields."""
    r = pb.RankingFeatures(candidate_item_ids=[1, 2], candidate_dense=candidate, user_dense=user, top_k=3)
    got_candidate, got_user = (packed_floats32([part]) for part in dense_parts(r))
    assert got_candidate.dtype == np.float32 and got_user.dtype == np.float32
    np.testing.assert_array_equal(got_candidate, np.asarray(candidate, dtype=np.float32))
    np.testing.assert_array_equal(got_user, np.asarray(user, dtype=np.float32))
