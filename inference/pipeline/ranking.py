"""Ranking requests -> one feature row (and item embedding row) per candidate -> the top-k by score.

A row is ``[candidate_dense | user_dense | tag buckets]``: the candidate's own features, then the request's
user features and hashed categorical tags, repeated on every candidate row of the request. A batch
concatenates the rows of its requests; the model scores each row independently. The widths come from the
model's parameters (``candidate_feature_width``, ``user_feature_width``, ``tag_buckets``) and must add up to
the model's feature width.

Dense features are normalised as the model was trained: the columns listed in ``candidate_log1p`` /
``user_log1p`` go through sign(x)·log(1 + |x|), then every column is standardised with ``*_mean`` /
``*_std`` (comma-separated, one per column) and clipped to ±``dense_clip``; without those parameters the
values pass unchanged. A model with a second input ``item_rows`` (INT64 [1]) gets each candidate's row in
its item embedding table: a 64-bit mix of the item id modulo ``item_table_rows`` (the hashing trick: any
id, no vocabulary to ship, collisions spread evenly).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgewire import pb
from edgewire.pb.edgeinfer.v1.views_pb2 import RankingDenseView
from inference.backends.base import ModelSpec
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import InvalidInput, batch_slices, tensor_from_array

SCORES = "scores"
ITEM_IDS = "item_ids"
ITEM_ROWS = "item_rows"
TOP_K = "top_k"


@dataclass(frozen=True, slots=True)
class DenseNorm:
    """sign·log1p on some columns, then (x - mean) / std, clipped: one block of dense features."""

    log1p: np.ndarray  # bool per column
    mean: np.ndarray  # per column: float32 values, held as float64 (see apply)
    std: np.ndarray
    clip: float

    @classmethod
    def of(cls, params: Mapping[str, str], prefix: str, width: int) -> DenseNorm | None:
        """From ``<prefix>_log1p``, ``_mean``, ``_std`` and ``dense_clip``; None when none is set."""
        names = (f"{prefix}_log1p", f"{prefix}_mean", f"{prefix}_std")
        if not any(params.get(n) for n in names):
            return None
        log1p = np.zeros(width, dtype=bool)
        for index in _floats(params.get(names[0], ""), names[0]):
            if not (index.is_integer() and 0 <= index < width):
                raise ValueError(f"{names[0]}: column {index} is not in 0..{width - 1}")
            log1p[int(index)] = True
        mean = _floats(params.get(names[1], ""), names[1]) or [0.0] * width
        std = _floats(params.get(names[2], ""), names[2]) or [1.0] * width
        if len(mean) != width or len(std) != width:
            raise ValueError(f"{names[1]} and {names[2]} need {width} values each")
        centre, scale = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
        if not np.isfinite(centre).all():
            raise ValueError(f"{names[1]}: every value must be a finite float32")
        if not (np.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{names[2]}: every value must be positive (and a finite float32)")
        clip = float(params.get("dense_clip", "8"))
        return cls(log1p, centre.astype(np.float64), scale.astype(np.float64), clip)

    def apply(self, block: np.ndarray) -> np.ndarray:
        """The normalised float32 copy of a (rows, width) float32 block of finite values, in a few
        whole-array operations. Standardised in float64: a float32 feature near its largest value (3e38)
        minus a mean, over a std below 1, overflows float32, never float64 (at most ~5e83 for float32
        operands); the clip then brings it to ±clip. Cheaper than clipping each column first."""
        out = np.where(self.log1p, np.sign(block) * np.log1p(np.abs(block)), block)
        out = (out - self.mean) / self.std
        clipped: np.ndarray = np.clip(out, -self.clip, self.clip).astype(np.float32)
        return clipped


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: not a comma-separated list of numbers: {text!r}") from None


def item_rows(item_ids: np.ndarray, table_rows: int) -> np.ndarray:
    """Embedding-table rows (int64) of uint64 item ids: SplitMix64's finaliser, modulo ``table_rows``."""
    z = item_ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z % np.uint64(table_rows)).astype(np.int64)


_LAYOUTS: dict[tuple[object, ...], RankingLayout] = {}


@dataclass(frozen=True, slots=True)
class RankingLayout:
    """Where each feature group sits in a row, and how dense features are normalised, from a model's spec."""

    input_name: str
    candidate_width: int
    user_width: int
    tag_buckets: int
    max_rows: int
    candidate_norm: DenseNorm | None = None
    user_norm: DenseNorm | None = None
    item_input: str = ""  # the item_rows input, when the model has one
    item_table_rows: int = 0

    @classmethod
    def of(cls, spec: ModelSpec) -> RankingLayout:
        """The layout of a ranking model (parsed once per model version and parameters); a spec whose
        widths do not add up is a ValueError."""
        key = (
            spec.name,
            spec.version,
            spec.max_batch_size,
            spec.inputs,
            tuple(sorted(spec.parameters.items())),
        )
        layout = _LAYOUTS.get(key)
        if layout is None:
            if len(_LAYOUTS) >= 256:  # bounded: a few models, a few versions
                _LAYOUTS.clear()
            layout = _LAYOUTS[key] = cls._parse(spec)
        return layout

    @classmethod
    def _parse(cls, spec: ModelSpec) -> RankingLayout:
        features, *extra = spec.inputs
        params = spec.parameters
        candidate_width = int(params.get("candidate_feature_width", "8"))
        user_width = int(params.get("user_feature_width", "16"))
        item_input = ""
        if extra:
            (items,) = extra
            if items.name != ITEM_ROWS or items.dims != (1,):
                raise ValueError(f"model {spec.name}: second input must be {ITEM_ROWS} [1], got {items.name}")
            item_input = items.name
        table_rows = int(params.get("item_table_rows", "0"))
        if item_input and table_rows < 1:
            raise ValueError(f"model {spec.name}: input {ITEM_ROWS} needs an item_table_rows parameter")
        layout = cls(
            input_name=features.name,
            candidate_width=candidate_width,
            user_width=user_width,
            tag_buckets=int(params.get("tag_buckets", "16")),
            max_rows=spec.max_batch_size,
            candidate_norm=DenseNorm.of(params, "candidate", candidate_width),
            user_norm=DenseNorm.of(params, "user", user_width),
            item_input=item_input,
            item_table_rows=table_rows,
        )
        if features.dims != (layout.width,):
            raise ValueError(
                f"model {spec.name}: input {features.name} dims {list(features.dims)} differ from "
                f"candidate + user + tag widths {layout.width}"
            )
        return layout

    @property
    def width(self) -> int:
        return self.candidate_width + self.user_width + self.tag_buckets


def tag_bucket(tag: str, buckets: int) -> int:
    """The bucket of one categorical tag: a stable hash (CRC-32 of its UTF-8), modulo the bucket count."""
    return zlib.crc32(tag.encode()) % buckets


class RankingPipeline:
    """Candidate rows in, top-k ``item_ids`` (UINT64 [k]) and ``scores`` (FP32 [k]) out per request."""

    kind = "ranking"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Build the batch's feature matrix: candidate blocks, user and tag rows repeated per candidate."""
        layout = RankingLayout.of(spec)
        # Packed little-endian float32 bytes (or, for a field that was not packed, the values), per kept
        # request: joined and read by numpy once per batch, not once per request.
        candidates: list[bytes | np.ndarray] = []
        users: list[bytes | np.ndarray] = []
        counts: list[int] = []
        kept: list[int] = []
        rejected: dict[int, tuple[str, str]] = {}
        for index, request in enumerate(requests):
            r = request.ranking
            problem = _feature_problem(r, layout)
            if problem:
                rejected[index] = (InvalidInput.BAD_FEATURES, problem)
                continue
            n = len(r.candidate_item_ids)
            if n > layout.max_rows:
                rejected[index] = (
                    InvalidInput.TOO_LARGE,
                    f"{n} candidates, the model takes {layout.max_rows}",
                )
                continue
            candidate_dense, user_dense = dense_parts(r)
            candidates.append(candidate_dense)
            users.append(user_dense)
            counts.append(n)
            kept.append(index)
        c, u, buckets = layout.candidate_width, layout.user_width, layout.tag_buckets
        candidate_block = packed_floats32(candidates).reshape(-1, c)
        user_block = packed_floats32(users).reshape(-1, u)
        if kept:
            candidate_block, user_block, kept, counts = _drop_non_finite(
                candidate_block, user_block, kept, counts, rejected
            )
        rows = int(sum(counts))
        features = np.empty((rows, layout.width), dtype=np.float32)
        inputs = {layout.input_name: features}
        if kept:
            repeats = np.asarray(counts)
            # The kept request's number and each tag's bucket: one bincount counts them all.
            tags = [
                number * buckets + tag_bucket(t, buckets)
                for number, index in enumerate(kept)
                for t in requests[index].ranking.categorical_tags
            ]
            if layout.candidate_norm is not None:
                candidate_block = layout.candidate_norm.apply(candidate_block)
            if layout.user_norm is not None:
                user_block = layout.user_norm.apply(user_block)
            tag_block = np.bincount(np.asarray(tags, dtype=np.intp), minlength=len(kept) * buckets)
            features[:, :c] = candidate_block
            features[:, c : c + u] = np.repeat(user_block, repeats, axis=0)
            features[:, c + u :] = np.repeat(tag_block.reshape(len(kept), buckets), repeats, axis=0)
        flat = np.fromiter(
            itertools.chain.from_iterable(requests[i].ranking.candidate_item_ids for i in kept),
            dtype=np.uint64,
            count=rows,
        )
        if layout.item_input:
            inputs[layout.item_input] = item_rows(flat, layout.item_table_rows).reshape(rows, 1)
        return Prepared(
            inputs=inputs,
            # finish orders these by score: it needs neither the requests nor their bytes again
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

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """Per kept request, its candidates ordered by score, best first, cut to ``top_k`` (0 = all); the
        item ids and ``top_k`` are what ``prepare`` kept (``extras``)."""
        scores = np.asarray(outputs[SCORES], dtype=np.float32).reshape(-1)
        ids, top_k = prepared.extras[ITEM_IDS], prepared.extras[TOP_K]
        counts = [r.stop - r.start for r in prepared.rows]
        chosen, lengths = top_k_orders(scores, counts, top_k)
        best_ids, best_scores = ids[chosen], scores[chosen]
        results: list[list[pb.Tensor]] = []
        end = 0
        for length in lengths.tolist():
            start, end = end, end + length
            results.append(
                [
                    tensor_from_array(ITEM_IDS, best_ids[start:end]),
                    tensor_from_array(SCORES, best_scores[start:end]),
                ]
            )
        return results


def dense_parts(r: pb.RankingFeatures) -> tuple[bytes | np.ndarray, bytes | np.ndarray]:
    """``candidate_dense`` and ``user_dense`` as packed little-endian float32 bytes, for numpy to read a
    whole batch of in one call (:func:`packed_floats32`).

    Read from the packed bytes of the message's serialization (proto/edgeinfer/v1/views.proto): the
    serializer writes each field as one packed record, which numpy takes in one call, about ten times
    faster than converting the repeated field value by value. A length that does not match (a field
    declared unpacked one day) falls back to the value-by-value read.
    """
    view = RankingDenseView.FromString(r.SerializeToString())
    return _packed(view.candidate_dense, r.candidate_dense), _packed(view.user_dense, r.user_dense)


def _packed(packed: bytes, values: Sequence[float]) -> bytes | np.ndarray:
    """A repeated float field's packed bytes when they hold every value, else the values read one by one."""
    if len(packed) == 4 * len(values):
        return packed
    return np.asarray(values, dtype=np.float32)


def packed_floats32(parts: Sequence[bytes | np.ndarray]) -> np.ndarray:
    """Packed float32 parts (bytes, or arrays for fields read value by value) as one float32 array."""
    packed = [p for p in parts if isinstance(p, bytes)]
    if len(packed) == len(parts):
        return np.frombuffer(b"".join(packed), dtype="<f4").astype(np.float32, copy=False)
    return np.concatenate(
        [np.frombuffer(p, dtype="<f4") if isinstance(p, bytes) else p for p in parts]
    ).astype(np.float32, copy=False)


def top_k_orders(
    scores: np.ndarray, counts: Sequence[int], top_k: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The top-k of every request of a batch in one sort: (chosen positions, how many per request).

    ``scores`` holds the requests' candidates one after another (``counts`` each); request ``i`` keeps
    its ``top_k[i]`` highest (0 = all), highest first, equal scores in position order, NaN last. The
    chosen positions of request ``i`` follow those of request ``i - 1``. One stable sort by (request,
    score descending) over the whole batch replaces a partition and a sort per request (~10 numpy calls
    each).
    """
    n = np.asarray(counts, dtype=np.int64)
    keys = np.where(np.isnan(scores), -np.inf, scores)
    request = np.repeat(np.arange(len(n)), n)
    order = np.lexsort((-keys, request))  # stable: equal keys stay in position order
    k = np.asarray(top_k, dtype=np.int64)
    wanted = np.where(k == 0, n, np.minimum(k, n))
    rank = np.arange(len(order)) - np.repeat(np.cumsum(n) - n, n)
    chosen: np.ndarray = order[rank < np.repeat(wanted, n)]
    return chosen, wanted


def _drop_non_finite(
    candidate_block: np.ndarray,
    user_block: np.ndarray,
    kept: list[int],
    counts: list[int],
    rejected: dict[int, tuple[str, str]],
) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """The blocks, kept requests and counts without the requests whose dense features hold a NaN or an
    infinity (those go to ``rejected`` as ``bad_features``): a model scores them as garbage, and the
    normalisation would compute with them. One pass over each block; the rest only when one is found."""
    if np.isfinite(candidate_block).all() and np.isfinite(user_block).all():
        return candidate_block, user_block, kept, counts  # the usual case: two flat passes, no per row
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


def _feature_problem(r: pb.RankingFeatures, layout: RankingLayout) -> str:
    n = len(r.candidate_item_ids)
    if n == 0:
        return "no candidates"
    if r.candidate_feature_width != layout.candidate_width:
        return (
            f"candidate_feature_width {r.candidate_feature_width}, the model takes {layout.candidate_width}"
        )
    if len(r.candidate_dense) != n * layout.candidate_width:
        return (
            f"candidate_dense has {len(r.candidate_dense)} values, {n} candidates x "
            f"{layout.candidate_width} need {n * layout.candidate_width}"
        )
    if len(r.user_dense) != layout.user_width:
        return f"user_dense has {len(r.user_dense)} values, the model takes {layout.user_width}"
    return ""
