"""The ranking pipeline's batch path (its requests' fields read as one message, tags bucketed through a
cache, the features read off the requests' own encodings) gives, bit for bit, what the per-request path it
replaced gives: features, item rows and extras, kept, rows, rejections with their reasons, and answers."""

from __future__ import annotations

import dataclasses
import itertools
import math
import struct
import warnings
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgewire import pb
from inference.backends.base import ModelSpec
from inference.pipeline import ranking
from inference.pipeline.base import Prepared
from inference.pipeline.ranking import (
    ITEM_IDS,
    TOP_K,
    RankingLayout,
    RankingPipeline,
    item_rows,
    packed_floats32,
)
from inference.pipeline.tensor import InvalidInput, batch_slices
from tests.edgewire.test_scan import varint
from tests.inference.pipeline.specs import demo_spec
from tests.inference.pipeline.test_ranking_alone import assert_same

DEMO = demo_spec("rank-mlp")
SPECS = {
    "demo": DEMO,
    "at most 20 rows": dataclasses.replace(DEMO, max_batch_size=20),
    "no norm, no item rows, 5 buckets": dataclasses.replace(
        DEMO,
        inputs=(dataclasses.replace(DEMO.inputs[0], dims=(8 + 16 + 5,)),),
        parameters={"candidate_feature_width": "8", "user_feature_width": "16", "tag_buckets": "5"},
        max_batch_size=64,
    ),
}

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e-45, 1e9, 3.4e38, -3.4e38, 0.5]
finite32 = st.one_of(st.sampled_from(SPECIAL), st.floats(width=32, allow_nan=False, allow_infinity=False))
any32 = st.one_of(finite32, st.sampled_from([math.nan, math.inf, -math.inf]))
TAGS = ["", "a", "b:1", "cat:x", "éü", "日本:語", "emoji:🙂", "x" * 300, "device:ios"]
ENCODINGS = ("canonical", "split records", "unpacked", "two ranking fields", "empty record last")


def _reference_non_finite(
    candidate_block: np.ndarray,
    user_block: np.ndarray,
    kept: list[int],
    counts: list[int],
    rejected: dict[int, tuple[str, str]],
) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    if np.isfinite(candidate_block).all() and np.isfinite(user_block).all():
        return candidate_block, user_block, kept, counts
    finite_rows = np.isfinite(candidate_block).all(axis=1)
    finite_users = np.isfinite(user_block).all(axis=1)
    sizes = np.asarray(counts, dtype=np.int64)
    finite_candidates = np.logical_and.reduceat(finite_rows, np.cumsum(sizes) - sizes)
    good = finite_candidates & finite_users
    for number in np.flatnonzero(~good).tolist():
        field = "candidate_dense" if not finite_candidates[number] else "user_dense"
        rejected[kept[number]] = (
            InvalidInput.BAD_FEATURES,
            f"{field} holds NaN or infinity; every feature value must be finite",
        )
    chosen = good.tolist()
    return (
        candidate_block[np.repeat(good, sizes)],
        user_block[good],
        [index for index, keep in zip(kept, chosen, strict=True) if keep],
        [count for count, keep in zip(counts, chosen, strict=True) if keep],
    )


def reference_prepare(requests: Sequence[pb.InferRequest], layout: RankingLayout) -> Prepared:
    """prepare_batch as it was before the batch path (8c103e9): each request's features serialized and
    read apart, each tag hashed, the ids chained."""
    candidates: list[bytes | np.ndarray] = []
    users: list[bytes | np.ndarray] = []
    counts: list[int] = []
    kept: list[int] = []
    rejected: dict[int, tuple[str, str]] = {}
    for index, request in enumerate(requests):
        r = request.ranking
        problem = ranking._feature_problem(r, layout)
        if problem:
            rejected[index] = (InvalidInput.BAD_FEATURES, problem)
            continue
        n = len(r.candidate_item_ids)
        if n > layout.max_rows:
            rejected[index] = (InvalidInput.TOO_LARGE, f"{n} candidates, the model takes {layout.max_rows}")
            continue
        candidate_dense, user_dense = ranking.dense_parts(r)
        candidates.append(candidate_dense)
        users.append(user_dense)
        counts.append(n)
        kept.append(index)
    c, u, buckets = layout.candidate_width, layout.user_width, layout.tag_buckets
    candidate_block = packed_floats32(candidates).reshape(-1, c)
    user_block = packed_floats32(users).reshape(-1, u)
    if kept:
        candidate_block, user_block, kept, counts = _reference_non_finite(
            candidate_block, user_block, kept, counts, rejected
        )
    rows = int(sum(counts))
    features = np.empty((rows, layout.width), dtype=np.float32)
    inputs = {layout.input_name: features}
    if kept:
        tags = [
            number * buckets + ranking.tag_bucket(t, buckets)
            for number, index in enumerate(kept)
            for t in requests[index].ranking.categorical_tags
        ]
        tag_block = np.bincount(np.asarray(tags, dtype=np.intp), minlength=len(kept) * buckets)
        shared = np.empty((len(kept), u + buckets), dtype=np.float32)
        shared[:, :u] = user_block
        shared[:, u:] = tag_block.reshape(len(kept), buckets)
        features[:, :c] = candidate_block
        features[:, c:] = np.repeat(shared, counts, axis=0)
        if layout.row_norm is not None:
            layout.row_norm.apply(features)
    flat = np.fromiter(
        itertools.chain.from_iterable(requests[i].ranking.candidate_item_ids for i in kept),
        dtype=np.uint64,
        count=rows,
    )
    if layout.item_input:
        inputs[layout.item_input] = item_rows(flat, layout.item_table_rows).reshape(rows, 1)
    return Prepared(
        inputs=inputs,
        extras={
            ITEM_IDS: flat,
            TOP_K: np.asarray([requests[i].ranking.top_k for i in kept], dtype=np.int64),
        },
        kept=kept,
        rows=batch_slices(counts),
        rejected=rejected,
        real_elements=int(features.size),
        padded_elements=int(features.size),
    )


def _key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _len(number: int, data: bytes) -> bytes:
    return _key(number, 2) + varint(len(data)) + data


def _floats(number: int, values: list[float], encoding: str) -> list[bytes]:
    """A repeated float field's records (each a separate field, so they may be spread over messages)."""
    raw = np.asarray(values, dtype="<f4").tobytes()
    if not values:
        return [_len(number, b"")] if encoding == "empty record last" else []
    if encoding == "unpacked":
        return [_key(number, 5) + raw[i : i + 4] for i in range(0, len(raw), 4)]
    if encoding in ("split records", "two ranking fields") and len(values) > 1:
        half = 4 * (len(values) // 2)
        return [_len(number, raw[:half]), _len(number, raw[half:])]
    records = [_len(number, raw)]
    return [*records, _len(number, b"")] if encoding == "empty record last" else records


def encode(r: pb.RankingFeatures, encoding: str) -> bytes:
    """An InferRequest holding ``r`` encoded one of the ways a peer may write it: as upb writes it,
    float fields in several packed records or unpacked, ids unpacked, the ranking field twice (protobuf
    merges the two), an empty packed record after the real one."""
    ids = list(r.candidate_item_ids)
    if encoding == "unpacked":
        id_records = [_key(3, 0) + varint(i) for i in ids]
    elif ids:
        id_records = [_len(3, b"".join(varint(i) for i in ids))]
    else:
        id_records = []
    records = [
        *id_records,
        *_floats(4, list(r.candidate_dense), encoding),
        *([_key(5, 0) + varint(r.candidate_feature_width)] if r.candidate_feature_width else []),
        *_floats(6, list(r.user_dense), encoding),
        *(_len(7, t.encode()) for t in r.categorical_tags),
        *([_key(8, 0) + varint(r.top_k)] if r.top_k else []),
    ]
    if encoding == "two ranking fields":  # every other record in a second ranking field, after other fields
        first, second = b"".join(records[0::2]), b"".join(records[1::2])
        body = _len(9, first) + _len(13, b"tenant") + _len(9, second)
    else:
        body = _len(9, b"".join(records))
    return _len(1, b"\x01" * 16) + _len(2, b"rank-mlp") + _key(4, 0) + varint(pb.REQUEST_KIND_RANKING) + body


@st.composite
def features(draw: st.DrawFn) -> pb.RankingFeatures:
    """A ranking request's features, now and then of the wrong shape, holding NaN, or with many tags."""
    n = draw(st.integers(0, 30))
    values = draw(st.sampled_from([finite32, finite32, any32]))
    width = draw(st.sampled_from([8, 8, 8, 8, 7]))
    dense = draw(st.sampled_from([0, 0, 0, 0, 1, -1]))
    users = draw(st.sampled_from([16, 16, 16, 16, 15, 0]))
    tags = draw(st.lists(st.sampled_from(TAGS), max_size=draw(st.sampled_from([3, 8, 60]))))
    return pb.RankingFeatures(
        user_id="u",
        candidate_item_ids=draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
        candidate_feature_width=width,
        candidate_dense=draw(
            st.lists(values, min_size=max(0, 8 * n + dense), max_size=max(0, 8 * n + dense))
        ),
        user_dense=draw(st.lists(values, min_size=users, max_size=users)),
        categorical_tags=tags,
        top_k=draw(st.integers(0, 35)),
    )


@st.composite
def batches(draw: st.DrawFn, most: int = 6) -> tuple[list[pb.InferRequest], list[bytes]]:
    """Requests and their encodings (each request parsed from its own)."""
    ranked = draw(st.lists(features(), min_size=1, max_size=most))
    payloads = [encode(r, draw(st.sampled_from(ENCODINGS))) for r in ranked]
    return [pb.InferRequest.FromString(p) for p in payloads], payloads


def assert_same_answers(fast: Prepared, general: Prepared, seed: int) -> None:
    """finish_bytes gives the same answers for both, with the same random scores."""
    rows = general.rows[-1].stop if general.rows else 0
    scores = np.random.default_rng(seed).standard_normal((rows, 1)).astype(np.float32)
    pipeline = RankingPipeline()
    assert pipeline.finish_bytes(fast, {"scores": scores}) == pipeline.finish_bytes(
        general, {"scores": scores}
    )


def prepare_both(spec: ModelSpec, requests: list[pb.InferRequest], payloads: list[bytes]) -> list[Prepared]:
    """Prepared without payloads, with payloads as bytes, and as views of one frame."""
    frame = memoryview(b"".join(payloads))
    views, start = [], 0
    for payload in payloads:
        views.append(frame[start : start + len(payload)])
        start += len(payload)
    pipeline = RankingPipeline()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            pipeline.prepare(requests, spec),
            pipeline.prepare_views(requests, payloads, spec),
            pipeline.prepare_views(requests, views, spec),
        ]


def prepared_as_the_reference(
    spec: ModelSpec, requests: list[pb.InferRequest], payloads: list[bytes], seed: int
) -> None:
    """prepare and prepare_views (with and without the requests' encodings) give the reference's batch:
    features, extras, kept, rows, rejections, and the same answers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        general = reference_prepare(requests, RankingLayout.of(spec))
    for fast in prepare_both(spec, requests, payloads):
        assert_same(fast, general)
        assert_same_answers(fast, general, seed)


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=80, deadline=None)
@given(batch=batches(), seed=st.integers(0, 2**16))
def test_a_batch_is_prepared_as_by_the_per_request_path(
    name: str, batch: tuple[list[pb.InferRequest], list[bytes]], seed: int
) -> None:
    """Batches of every encoding, shape, tag and value: prepare and prepare_views give the reference's
    features, extras, kept, rows and rejections, and the same answers."""
    prepared_as_the_reference(SPECS[name], *batch, seed)


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=80, deadline=None)
@given(batch=batches(most=1), seed=st.integers(0, 2**16))
def test_a_lone_request_is_prepared_as_by_the_per_request_path(
    name: str, batch: tuple[list[pb.InferRequest], list[bytes]], seed: int
) -> None:
    """A lone request (its own path, its encoding read or not) gives the reference's batch of one."""
    prepared_as_the_reference(SPECS[name], *batch, seed)


@settings(max_examples=40, deadline=None)
@given(batch=batches(most=3), other=batches(most=3))
def test_payloads_that_are_not_the_requests_encodings_are_not_read(
    batch: tuple[list[pb.InferRequest], list[bytes]], other: tuple[list[pb.InferRequest], list[bytes]]
) -> None:
    """Payloads that cannot be the requests' encodings (another count of them, or of candidates) are
    not read: the requests' own fields decide."""
    requests, _ = batch
    _, payloads = other
    assume(
        len(payloads) != len(requests)
        or [len(pb.InferRequest.FromString(p).ranking.candidate_item_ids) for p in payloads]
        != [len(r.ranking.candidate_item_ids) for r in requests]
    )
    general = reference_prepare(requests, RankingLayout.of(DEMO))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = RankingPipeline().prepare_views(requests, payloads, DEMO)
    assert_same(prepared, general)


def test_the_tag_cache_is_bounded_and_forgets_nothing_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound the tag cache starts over; every bucket stays the tag's CRC-32 modulo the count."""
    monkeypatch.setattr(ranking, "TAG_CACHE_SIZE", 8)
    cache = ranking.TagBuckets(7)
    tags = [f"tag:{i}" for i in range(50)]
    for tag in tags * 2:
        assert cache[tag.encode()] == cache[tag] == ranking.tag_bucket(tag, 7)
        assert len(cache) <= 8


def test_a_batch_of_many_distinct_tags_is_bucketed_as_by_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More distinct tags in one batch than the cache holds: the cache starts over mid-batch, the counts
    stay the reference's."""
    monkeypatch.setattr(ranking, "TAG_CACHE_SIZE", 16)
    rng = np.random.default_rng(3)
    requests = [
        pb.InferRequest(
            ranking=pb.RankingFeatures(
                candidate_item_ids=[i + 1],
                candidate_feature_width=8,
                candidate_dense=rng.standard_normal(8).tolist(),
                user_dense=rng.standard_normal(16).tolist(),
                categorical_tags=[f"t:{i}:{j}" for j in range(40)],
            )
        )
        for i in range(10)
    ]
    layout = RankingLayout.of(DEMO)
    assert_same(RankingPipeline().prepare(requests, DEMO), reference_prepare(requests, layout))


def test_an_unpacked_encoding_is_read_value_by_value() -> None:
    """Float fields written unpacked are not in the packed columns: the batch reads them from the
    requests (the reference's values), with or without their encodings."""
    r = pb.RankingFeatures(
        candidate_item_ids=[5, 6],
        candidate_feature_width=8,
        candidate_dense=[float(i) for i in range(16)],
        user_dense=[0.5] * 16,
        categorical_tags=["a"],
    )
    payloads = [encode(r, "unpacked"), encode(r, "canonical")]
    requests = [pb.InferRequest.FromString(p) for p in payloads]
    general = reference_prepare(requests, RankingLayout.of(DEMO))
    assert general.kept == [0, 1]
    for fast in prepare_both(DEMO, requests, payloads):
        assert_same(fast, general)


def test_float_bits_survive_the_packed_read() -> None:
    """-0.0, the smallest subnormal and the largest float32 reach the rows with their exact bits."""
    edge = [struct.unpack("<f", struct.pack("<I", bits))[0] for bits in (0x80000000, 0x00000001, 0x7F7FFFFF)]
    r = pb.RankingFeatures(
        candidate_item_ids=[2**64 - 1],
        candidate_feature_width=8,
        candidate_dense=[*edge, *edge, 0.0, 1.0],
        user_dense=[*edge] * 5 + [2.0],
    )
    payload = encode(r, "split records")
    requests = [pb.InferRequest.FromString(payload)] * 3
    general = reference_prepare(requests, RankingLayout.of(DEMO))
    for fast in prepare_both(DEMO, requests, [payload] * 3):
        assert_same(fast, general)


def test_payloads_holding_other_candidates_are_not_read() -> None:
    """Payloads as many as the requests but holding more candidates: the requests' own fields decide."""
    rng = np.random.default_rng(5)

    def request(n: int) -> pb.RankingFeatures:
        return pb.RankingFeatures(
            candidate_item_ids=list(range(100 * n, 101 * n)),
            candidate_feature_width=8,
            candidate_dense=rng.standard_normal(8 * n).tolist(),
            user_dense=rng.standard_normal(16).tolist(),
            categorical_tags=["a"],
        )

    requests = [pb.InferRequest(ranking=request(n)) for n in (2, 3)]
    payloads = [encode(request(n), "canonical") for n in (3, 4)]
    general = reference_prepare(requests, RankingLayout.of(DEMO))
    assert_same(RankingPipeline().prepare_views(requests, payloads, DEMO), general)
    assert_same(RankingPipeline().prepare_views(requests[:1], payloads[:1], DEMO), general_one(requests[0]))


def general_one(request: pb.InferRequest) -> Prepared:
    return reference_prepare([request], RankingLayout.of(DEMO))
