"""The ranking batch's flat normalisation (FlatNorm: dense values normalised before they are spread over
rows) and its one-key top-k sort give, bit for bit, what the whole-row RowNorm and the lexsort give."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from inference.pipeline.base import Prepared
from inference.pipeline.ranking import (
    TILED_ROWS,
    RankingLayout,
    prepare_batch,
    top_k_orders,
    top_k_orders_sorted,
)
from tests.inference.pipeline.test_ranking_alone import SPECS, assert_same, ranking_requests


def by_whole_rows(requests: list[pb.InferRequest], layout: RankingLayout) -> Prepared:
    """prepare_batch with every row normalised whole (RowNorm.apply), the path before FlatNorm."""
    return prepare_batch(requests, dataclasses.replace(layout, flat_norm=None))


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=30, deadline=None)
@given(requests=st.lists(ranking_requests(finite=False, most=20), min_size=1, max_size=6))
def test_a_batch_normalised_flat_equals_it_normalised_row_by_row(
    name: str, requests: list[pb.InferRequest]
) -> None:
    """Every kind of norm and clip, NaN and infinity refused as before: the same prepared batch."""
    layout = RankingLayout.of(SPECS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clip 0.001 and the like: no overflow, but say nothing either way
        flat = prepare_batch(requests, layout)
        whole = by_whole_rows(requests, layout)
    assert_same(flat, whole)


def test_a_batch_of_more_rows_than_are_tiled_is_normalised_row_by_row() -> None:
    """Past TILED_ROWS rows FlatNorm declines and RowNorm broadcasts: the same values either way."""
    layout = RankingLayout.of(SPECS["demo"])
    assert layout.flat_norm is not None
    rng = np.random.default_rng(5)
    n = layout.max_rows
    requests = [
        pb.InferRequest(
            ranking=pb.RankingFeatures(
                candidate_item_ids=rng.integers(0, 2**63, n).tolist(),
                candidate_feature_width=8,
                candidate_dense=(rng.standard_normal(8 * n) * 10).astype(np.float32).tolist(),
                user_dense=(rng.standard_normal(16) * 10).astype(np.float32).tolist(),
                categorical_tags=["device:ios", f"cat:{i % 7}"],
                top_k=10,
            )
        )
        for i in range(TILED_ROWS // n + 1)
    ]
    assert layout.flat_norm.apply(np.zeros(TILED_ROWS + 1, dtype=np.float32), TILED_ROWS + 1, 1) is None
    assert_same(prepare_batch(requests, layout), by_whole_rows(requests, layout))


float32_bits = st.integers(0, 2**32 - 1).map(lambda b: np.array([b], dtype=np.uint32).view(np.float32)[0])
scores32 = st.one_of(
    float32_bits,
    st.sampled_from([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, -3.4e38]),
)


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.lists(scores32, min_size=1, max_size=30), st.integers(0, 35)), min_size=1, max_size=8
    )
)
def test_the_one_key_sort_chooses_as_the_lexsort(requests: list[tuple[list[float], int]]) -> None:
    """Any float32 scores (every NaN, signalling ones too, both zeros, subnormals, infinities): the same
    positions and lengths as the lexsort of (request, score descending)."""
    scores = np.array([s for own, _ in requests for s in own], dtype=np.float32)
    counts = [len(own) for own, _ in requests]
    top_k = np.array([k for _, k in requests], dtype=np.int64)
    chosen, lengths = top_k_orders(scores, counts, top_k)
    want, want_lengths = top_k_orders_sorted(scores, counts, top_k)
    assert (chosen.dtype, lengths.dtype) == (want.dtype, want_lengths.dtype)
    assert chosen.tolist() == want.tolist() and lengths.tolist() == want_lengths.tolist()
