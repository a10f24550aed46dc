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

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, cast

import numpy as np

from edgewire import pb
from edgewire.pb.edgeinfer.v1.views_pb2 import (
    RankingColumns,
    RankingDenseView,
    RequestRankingColumns,
    RequestRankingDenseView,
)
from edgewire.scan import Buffer
from inference.backends.base import ModelSpec
from inference.pipeline.base import Prepared
from inference.pipeline.tensor import InvalidInput, batch_slices, output_prefix, tensor_from_array, wire_data

SCORES = "scores"
ITEM_IDS = "item_ids"
ITEM_ROWS = "item_rows"
TOP_K = "top_k"
TILED_ROWS: Final = 4096
"""Rows up to which a layout keeps its per-column constants tiled (see :class:`RowNorm`); a batch of more
broadcasts them."""
_FLOAT32_LE: Final = np.dtype("<f4")


@dataclass(frozen=True, slots=True)
class DenseNorm:
    """sign·log1p on some columns, then (x - mean) / std, clipped: one block of dense features."""

    log1p: np.ndarray  # bool per column
    mean: np.ndarray  # per column: float32 values, held as float64 (see RowNorm)
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
        operands); the clip then brings it to ±clip. Cheaper than clipping each column first.

        The definition :class:`RowNorm` computes faster on whole rows, and what it runs where the clip is
        not above 0."""
        out = np.where(self.log1p, np.sign(block) * np.log1p(np.abs(block)), block)
        out = (out - self.mean) / self.std
        clipped: np.ndarray = np.clip(out, -self.clip, self.clip).astype(np.float32)
        return clipped


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name}: not a comma-separated list of numbers: {text!r}") from None


@dataclass(frozen=True, slots=True)
class RowNorm:
    """The dense normalisation of whole feature rows ``[candidate | user | tags]``: each block's
    :class:`DenseNorm` side by side, the tag counts (and a block without a norm) passed unchanged.

    Value for value what :meth:`DenseNorm.apply` gives each block, in a few in-place operations on one
    float64 copy of the rows: sign·log1p in float32 on the log1p columns only, then (x - mean) / std in
    float64 (a float32 feature near its largest value (3e38) minus a mean, over a std below 1, overflows
    float32, never float64), then the clip, then back to float32. A column passed unchanged has mean 0,
    std 1 and bounds ±inf, which give every finite float32 back bit for bit. The per-column constants are
    kept tiled to the batch's rows: a ufunc over two arrays of one shape is one inner loop, where
    broadcasting a row of constants costs a loop per row (three times the time for a lone request's 20
    rows).
    """

    log1p: np.ndarray  # intp: the columns that go through sign·log1p
    mean: np.ndarray  # float64 per column
    std: np.ndarray
    low: np.ndarray  # -clip per column
    high: np.ndarray
    # Every clip > 0: np.maximum then np.minimum give np.clip's values (no bound is a zero, whose sign
    # np.clip with scalar bounds treats its own way); otherwise each block goes through DenseNorm.apply.
    min_max: bool
    blocks: tuple[tuple[int, int, DenseNorm], ...]  # (first column, end, norm) of each normalised block
    _tiled: list[_Tiled] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(cls, blocks: Sequence[tuple[DenseNorm | None, int]], passed: int) -> RowNorm | None:
        """The norm of rows made of ``blocks`` (each a norm or None, and its width), then ``passed``
        columns left as they are; None when no block has a norm."""
        if all(norm is None for norm, _ in blocks):
            return None
        log1p: list[np.ndarray] = []
        mean: list[np.ndarray] = []
        std: list[np.ndarray] = []
        low: list[np.ndarray] = []
        high: list[np.ndarray] = []
        start = 0
        normalised: list[tuple[int, int, DenseNorm]] = []
        for norm, width in blocks:
            if norm is None:
                mean.append(np.zeros(width))
                std.append(np.ones(width))
                low.append(np.full(width, -np.inf))
                high.append(np.full(width, np.inf))
            else:
                log1p.append(start + np.flatnonzero(norm.log1p))
                mean.append(norm.mean)
                std.append(norm.std)
                low.append(np.full(width, -norm.clip))
                high.append(np.full(width, norm.clip))
                normalised.append((start, start + width, norm))
            start += width
        mean.append(np.zeros(passed))
        std.append(np.ones(passed))
        low.append(np.full(passed, -np.inf))
        high.append(np.full(passed, np.inf))
        return cls(
            log1p=np.concatenate(log1p).astype(np.intp),
            mean=np.concatenate(mean).astype(np.float64),
            std=np.concatenate(std).astype(np.float64),
            low=np.concatenate(low).astype(np.float64),
            high=np.concatenate(high).astype(np.float64),
            min_max=all(norm.clip > 0 for _, _, norm in normalised),
            blocks=tuple(normalised),
        )

    def apply(self, rows: np.ndarray) -> None:
        """Normalise a (rows, width) float32 array of finite values in place."""
        if not self.min_max:
            for start, end, norm in self.blocks:
                rows[:, start:end] = norm.apply(np.ascontiguousarray(rows[:, start:end]))
            return
        x = rows.astype(np.float64)
        count = len(rows)
        tiled = self._tiled_for(count)
        if tiled is None:  # more rows than are tiled: the constants broadcast
            if self.log1p.size:
                logged = rows.take(self.log1p, axis=1)  # float32, as the block's own values
                x[:, self.log1p] = np.sign(logged) * np.log1p(np.abs(logged))
            mean, std, low, high = self.mean, self.std, self.low, self.high
        else:
            if self.log1p.size:
                cells = tiled.log1p[: count * len(self.log1p)]  # flat positions: put, take cost half
                logged = rows.take(cells)
                x.put(cells, np.sign(logged) * np.log1p(np.abs(logged)))
            mean, std, low, high = (
                tiled.mean[:count],
                tiled.std[:count],
                tiled.low[:count],
                tiled.high[:count],
            )
        np.subtract(x, mean, out=x)
        np.divide(x, std, out=x)
        np.maximum(x, low, out=x)
        np.minimum(x, high, out=x)
        rows[...] = x

    def _tiled_for(self, rows: int) -> _Tiled | None:
        """The constants tiled to at least ``rows`` rows; None beyond :data:`TILED_ROWS`."""
        if rows > TILED_ROWS:
            return None
        tiled = self._tiled[-1] if self._tiled else None
        if tiled is None or len(tiled.mean) < rows:
            capacity = min(max(64, 1 << (rows - 1).bit_length()), TILED_ROWS)
            width = len(self.mean)
            cells = (np.arange(capacity, dtype=np.intp)[:, np.newaxis] * width + self.log1p).reshape(-1)
            mean, std, low, high = (
                np.tile(a, (capacity, 1)) for a in (self.mean, self.std, self.low, self.high)
            )
            tiled = _Tiled(cells, mean, std, low, high)
            self._tiled[:] = [tiled]  # one list item replaced whole: the loop and a thread may both read
        return tiled


@dataclass(frozen=True, slots=True)
class _Tiled:
    """A :class:`RowNorm`'s constants for a number of rows: its log1p cells as flat positions in rows of
    its width, and mean, std and bounds per row."""

    log1p: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    low: np.ndarray
    high: np.ndarray


@dataclass(frozen=True, slots=True)
class FlatNorm:
    """The dense normalisation of a batch's dense values laid flat, before they are spread over rows: its
    candidate values (rows x candidate width, row by row) then its user values (one row per request).

    Value for value what :class:`RowNorm` gives the rows those values are repeated on (every step is
    element by element, so a user row normalised once equals it normalised on each of its candidate rows),
    in fewer and smaller operations: a request's user features once instead of on every candidate row, the
    tag counts (which the norm passes unchanged) not at all, one float64 copy of every value. Only where
    every clip is above 0 (:attr:`RowNorm.min_max`); a block without a norm is left as it is."""

    candidate: DenseNorm | None
    user: DenseNorm | None
    candidate_width: int
    user_width: int
    _tiled: list[_FlatTiled] = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def of(
        cls, candidate: DenseNorm | None, candidate_width: int, user: DenseNorm | None, user_width: int
    ) -> FlatNorm | None:
        """None when neither block has a norm, or one clips at 0 or below."""
        norms = [n for n in (candidate, user) if n is not None]
        if not norms or not all(n.clip > 0 for n in norms):
            return None
        return cls(candidate, user, candidate_width, user_width)

    def apply(self, values: np.ndarray, rows: int, requests: int) -> np.ndarray | None:
        """The normalised float64 copy of a batch's flat float32 values of ``rows`` candidates and
        ``requests`` requests, all finite; None beyond :data:`TILED_ROWS` rows."""
        tiled = self._tiled_for(rows)
        if tiled is None:
            return None
        candidate, user = self.candidate, self.user
        split = rows * self.candidate_width
        x = values.astype(np.float64)
        cells = tiled.candidate_cells[: rows * tiled.candidate_logged]
        if tiled.user_logged:
            user_cells = tiled.user_cells[: requests * tiled.user_logged] + split
            cells = np.concatenate((cells, user_cells)) if len(cells) else user_cells
        if len(cells):
            logged = values.take(cells)  # float32, as the block's own values
            x.put(cells, np.sign(logged) * np.log1p(np.abs(logged)))
        if candidate is not None:
            part = x[:split]
            np.subtract(part, tiled.candidate_mean[:split], out=part)
            np.divide(part, tiled.candidate_std[:split], out=part)
        if user is not None:
            part, end = x[split:], requests * self.user_width
            np.subtract(part, tiled.user_mean[:end], out=part)
            np.divide(part, tiled.user_std[:end], out=part)
        if candidate is not None and user is not None and candidate.clip == user.clip:
            np.maximum(x, -candidate.clip, out=x)
            np.minimum(x, candidate.clip, out=x)
            return x
        for norm, part in ((candidate, x[:split]), (user, x[split:])):
            if norm is not None:
                np.maximum(part, -norm.clip, out=part)
                np.minimum(part, norm.clip, out=part)
        return x

    def _tiled_for(self, rows: int) -> _FlatTiled | None:
        """The constants tiled to at least ``rows`` rows; None beyond :data:`TILED_ROWS`."""
        if rows > TILED_ROWS:
            return None
        tiled = self._tiled[-1] if self._tiled else None
        if tiled is None or tiled.rows < rows:
            capacity = min(max(64, 1 << (rows - 1).bit_length()), TILED_ROWS)
            parts: list[np.ndarray] = []
            logged: list[int] = []
            for norm, width in ((self.candidate, self.candidate_width), (self.user, self.user_width)):
                columns = np.flatnonzero(norm.log1p) if norm is not None else np.zeros(0, dtype=np.intp)
                cells = np.arange(capacity, dtype=np.intp)[:, np.newaxis] * width + columns
                mean = np.zeros(width) if norm is None else norm.mean
                std = np.ones(width) if norm is None else norm.std
                parts += (cells.reshape(-1).astype(np.intp), np.tile(mean, capacity), np.tile(std, capacity))
                logged.append(len(columns))
            tiled = _FlatTiled(capacity, logged[0], logged[1], *parts)
            self._tiled[:] = [tiled]  # one list item replaced whole: the loop and a thread may both read
        return tiled


@dataclass(frozen=True, slots=True)
class _FlatTiled:
    """A :class:`FlatNorm`'s constants for up to ``rows`` rows of each block: its log1p cells as flat
    positions in the block's values, how many per row, and mean and std per value."""

    rows: int
    candidate_logged: int
    user_logged: int
    candidate_cells: np.ndarray
    candidate_mean: np.ndarray
    candidate_std: np.ndarray
    user_cells: np.ndarray
    user_mean: np.ndarray
    user_std: np.ndarray


_MIX_ADD: Final = np.uint64(0x9E3779B97F4A7C15)
_MIX_1: Final = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2: Final = np.uint64(0x94D049BB133111EB)
_SHIFTS: Final = (np.uint64(30), np.uint64(27), np.uint64(31))


def item_rows(item_ids: np.ndarray, table_rows: int) -> np.ndarray:
    """Embedding-table rows (int64) of uint64 item ids: SplitMix64's finaliser, modulo ``table_rows``."""
    z = np.add(item_ids.astype(np.uint64, copy=False), _MIX_ADD)  # a new array: the ids stay as they are
    t = np.right_shift(z, _SHIFTS[0])
    z ^= t
    z *= _MIX_1
    np.right_shift(z, _SHIFTS[1], out=t)
    z ^= t
    z *= _MIX_2
    np.right_shift(z, _SHIFTS[2], out=t)
    z ^= t
    if table_rows & (table_rows - 1) == 0:  # a power of two: the same rows as the remainder, cheaper
        np.bitwise_and(z, np.uint64(table_rows - 1), out=z)
    else:
        np.remainder(z, np.uint64(table_rows), out=z)
    return z.view(np.int64)  # below table_rows: the same values, without a copy


_LAYOUTS: dict[tuple[object, ...], RankingLayout] = {}
_LAYOUT_OF_SPEC: dict[int, tuple[ModelSpec, RankingLayout]] = {}  # id(spec) -> (spec, its layout)


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
    row_norm: RowNorm | None = None  # both norms over whole rows
    flat_norm: FlatNorm | None = None  # both norms over a batch's flat values (prepare_batch)

    @classmethod
    def of(cls, spec: ModelSpec) -> RankingLayout:
        """The layout of a ranking model (parsed once per model version and parameters); a spec whose
        widths do not add up is a ValueError."""
        # By the spec object first: the key below (its parameters sorted) costs microseconds per batch.
        known = _LAYOUT_OF_SPEC.get(id(spec))
        if known is not None and known[0] is spec:
            return known[1]
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
        if len(_LAYOUT_OF_SPEC) >= 256:
            _LAYOUT_OF_SPEC.clear()
        _LAYOUT_OF_SPEC[id(spec)] = (spec, layout)  # holds the spec: its id is not reused meanwhile
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
        candidate_norm = DenseNorm.of(params, "candidate", candidate_width)
        user_norm = DenseNorm.of(params, "user", user_width)
        tag_buckets = int(params.get("tag_buckets", "16"))
        layout = cls(
            input_name=features.name,
            candidate_width=candidate_width,
            user_width=user_width,
            tag_buckets=tag_buckets,
            max_rows=spec.max_batch_size,
            candidate_norm=candidate_norm,
            user_norm=user_norm,
            item_input=item_input,
            item_table_rows=table_rows,
            row_norm=RowNorm.of(((candidate_norm, candidate_width), (user_norm, user_width)), tag_buckets),
            flat_norm=FlatNorm.of(candidate_norm, candidate_width, user_norm, user_width),
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


TAG_CACHE_SIZE: Final = 4096
"""Tags remembered per bucket count (categorical: a few hundred distinct values); past it, forgotten."""


class TagBuckets(dict[str | bytes, int]):
    """Each tag's :func:`tag_bucket`, by the tag or its UTF-8 bytes, for one bucket count: a tag seen
    before costs a dict look-up (``map(buckets.__getitem__, tags)`` stays in C), a new one its CRC-32.
    Bounded: cleared when full."""

    def __init__(self, buckets: int) -> None:
        super().__init__()
        self.buckets = buckets

    def __missing__(self, tag: str | bytes) -> int:
        if len(self) >= TAG_CACHE_SIZE:
            self.clear()
        bucket = self[tag] = zlib.crc32(tag.encode() if isinstance(tag, str) else tag) % self.buckets
        return bucket


_TAG_BUCKETS: dict[int, TagBuckets] = {}


def tag_buckets(buckets: int) -> TagBuckets:
    """The shared :class:`TagBuckets` of a bucket count."""
    known = _TAG_BUCKETS.get(buckets)
    if known is None:
        if len(_TAG_BUCKETS) >= 64:  # bounded: a few models
            _TAG_BUCKETS.clear()
        known = _TAG_BUCKETS[buckets] = TagBuckets(buckets)
    return known


def rankings_as_columns(data: bytes) -> RankingColumns:
    """Concatenated ``RankingFeatures`` encodings as one :class:`RankingColumns` (views.proto)."""
    return RankingColumns.FromString(data)


def requests_as_columns(data: bytes) -> RankingColumns:
    """Concatenated ``InferRequest`` encodings' ranking fields as one :class:`RankingColumns`."""
    return RequestRankingColumns.FromString(data).ranking


def request_dense(data: Buffer) -> tuple[bytes, bytes]:
    """One ``InferRequest`` encoding's last ``candidate_dense`` and ``user_dense`` records, as
    RankingDenseView reads a ``RankingFeatures``."""
    # upb parses any buffer without a copy (a frame's views included); the stubs only admit bytes.
    view = RequestRankingDenseView.FromString(cast(bytes, data)).ranking
    return bytes(view.candidate_dense), bytes(view.user_dense)


def ranking_columns(
    rankings: Sequence[pb.RankingFeatures], payloads: Sequence[Buffer] | None, candidates: int
) -> RankingColumns:
    """The requests' :class:`RankingColumns`: from their own encodings (``payloads``, the
    ``InferRequest`` bytes they were parsed from) when given and they hold all the ``candidates``, else
    from the ``rankings`` serialized."""
    if payloads is not None:
        columns = requests_as_columns(b"".join(payloads))
        if len(columns.candidate_item_ids) == candidates:
            return columns
    return rankings_as_columns(b"".join([r.SerializeToString() for r in rankings]))


class RankingPipeline:
    """Candidate rows in, top-k ``item_ids`` (UINT64 [k]) and ``scores`` (FP32 [k]) out per request."""

    kind = "ranking"

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Build the batch's feature matrix: candidate blocks, user and tag rows repeated per candidate."""
        return self.prepare_views(requests, None, spec)

    def prepare_views(
        self, requests: Sequence[pb.InferRequest], payloads: Sequence[Buffer] | None, spec: ModelSpec
    ) -> Prepared:
        """:meth:`prepare`, the features read from ``payloads[i]``, the encoding of ``requests[i]``, instead
        of serializing them again (None, or a count that differs: serialized)."""
        layout = RankingLayout.of(spec)
        if payloads is not None and len(payloads) != len(requests):
            payloads = None
        if len(requests) == 1:  # a lone (realtime) request: no joining, counting or repeating
            alone = prepare_alone(requests[0], layout, None if payloads is None else payloads[0])
            if alone is not None:
                return alone
        return prepare_batch(requests, layout, payloads)

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """Per kept request, its candidates ordered by score, best first, cut to ``top_k`` (0 = all); the
        item ids and ``top_k`` are what ``prepare`` kept (``extras``)."""
        best_ids, best_scores, lengths = ranked(prepared, outputs)
        results: list[list[pb.Tensor]] = []
        end = 0
        for length in lengths:
            start, end = end, end + length
            results.append(
                [
                    tensor_from_array(ITEM_IDS, best_ids[start:end]),
                    tensor_from_array(SCORES, best_scores[start:end]),
                ]
            )
        return results

    def finish_bytes(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
        """:meth:`finish`, each request's answer serialized: the batch's ids and scores converted once,
        then each request's bytes cut from them behind a prefix cached per length."""
        best_ids, best_scores, lengths = ranked(prepared, outputs)
        ids_type, ids_raw = wire_data(ITEM_IDS, best_ids)
        scores_type, scores_raw = wire_data(SCORES, best_scores)
        ids_size, scores_size = best_ids.itemsize, best_scores.itemsize
        if len(lengths) == 1:  # a lone request: its whole arrays
            (length,) = lengths
            ids_prefix = output_prefix(ITEM_IDS, ids_type, (length,), length * ids_size)
            scores_prefix = output_prefix(SCORES, scores_type, (length,), length * scores_size)
            return [b"".join((ids_prefix, ids_raw, scores_prefix, scores_raw))]
        answers: list[bytes] = []
        prefixes: dict[int, tuple[bytes, bytes]] = {}  # by length: most requests of a batch share a top_k
        end = 0
        for length in lengths:
            start, end = end, end + length
            prefix = prefixes.get(length)
            if prefix is None:
                prefix = prefixes[length] = (
                    output_prefix(ITEM_IDS, ids_type, (length,), length * ids_size),
                    output_prefix(SCORES, scores_type, (length,), length * scores_size),
                )
            answers.append(
                b"".join(
                    (
                        prefix[0],
                        ids_raw[start * ids_size : end * ids_size],
                        prefix[1],
                        scores_raw[start * scores_size : end * scores_size],
                    )
                )
            )
        return answers


def ranked(prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Every kept request's chosen candidates, one request after another: (item ids, float32 scores, how
    many per request)."""
    scores = np.asarray(outputs[SCORES], dtype=np.float32).reshape(-1)
    ids, top_k = prepared.extras[ITEM_IDS], prepared.extras[TOP_K]
    rows = prepared.rows
    if len(rows) == 1 and rows[0].stop - rows[0].start == len(scores):
        chosen = top_k_order(scores, int(top_k[0]))
        return ids[chosen], scores[chosen], [len(chosen)]
    counts = [r.stop - r.start for r in rows]
    chosen, lengths = _top_k_chosen(scores, counts, top_k)
    return ids[chosen], scores[chosen], lengths


def prepare_batch(
    requests: Sequence[pb.InferRequest], layout: RankingLayout, payloads: Sequence[Buffer] | None = None
) -> Prepared:
    """:meth:`RankingPipeline.prepare` for any batch: the rejected requests dropped, the others' repeated
    fields read as one message (:func:`ranking_columns`; ``payloads``: the requests' own encodings, read
    there instead of serializing them again), every row built and normalised in a few whole-array
    operations."""
    c, u, buckets, most = layout.candidate_width, layout.user_width, layout.tag_buckets, layout.max_rows
    rankings: list[pb.RankingFeatures] = []
    counts: list[int] = []
    kept: list[int] = []
    rejected: dict[int, tuple[str, str]] = {}
    for index, request in enumerate(requests):
        r = request.ranking
        n = len(r.candidate_item_ids)
        if not (
            0 < n <= most
            and r.candidate_feature_width == c
            and len(r.candidate_dense) == n * c
            and len(r.user_dense) == u
        ):
            problem = _feature_problem(r, layout)
            if problem:
                rejected[index] = (InvalidInput.BAD_FEATURES, problem)
                continue
            if n > most:
                rejected[index] = (InvalidInput.TOO_LARGE, f"{n} candidates, the model takes {most}")
                continue
        rankings.append(r)
        counts.append(n)
        kept.append(index)
    rows = sum(counts)
    columns = ranking_columns(rankings, None if payloads is None else [payloads[i] for i in kept], rows)
    values = _dense_values(columns, rankings, rows, layout)
    flat = np.fromiter(columns.candidate_item_ids, dtype=np.uint64, count=rows)
    tag_block = _tag_counts(columns, rankings, buckets)
    if kept and not np.logical_and.reduce(np.isfinite(values)):  # one pass over every dense value
        candidate_block, user_block = values[: rows * c].reshape(rows, c), values[rows * c :].reshape(-1, u)
        good = _finite_requests(candidate_block, user_block, kept, counts, rejected)
        if good is not None:  # some hold NaN or infinity: dropped from every column
            by_row = np.repeat(good, counts)
            candidate_block, user_block, flat = candidate_block[by_row], user_block[good], flat[by_row]
            values = np.concatenate((candidate_block.reshape(-1), user_block.reshape(-1)))
            tag_block = tag_block[good]
            chosen = good.tolist()
            kept = [index for index, keep in zip(kept, chosen, strict=True) if keep]
            counts = [count for count, keep in zip(counts, chosen, strict=True) if keep]
            rankings = [r for r, keep in zip(rankings, chosen, strict=True) if keep]
            rows = sum(counts)
    features = _features(values, tag_block, counts, layout)
    inputs = {layout.input_name: features}
    if layout.item_input:
        inputs[layout.item_input] = item_rows(flat, layout.item_table_rows).reshape(rows, 1)
    return Prepared(
        inputs=inputs,
        # finish orders these by score: it needs neither the requests nor their bytes again
        extras={ITEM_IDS: flat, TOP_K: np.asarray([r.top_k for r in rankings], dtype=np.int64)},
        kept=kept,
        rows=batch_slices(counts),
        rejected=rejected,
        real_elements=int(features.size),
        padded_elements=int(features.size),
    )


def _features(
    values: np.ndarray, tag_block: np.ndarray, counts: list[int], layout: RankingLayout
) -> np.ndarray:
    """A batch's feature rows from its flat dense values (:func:`_dense_values`, every value finite) and
    tag counts, normalised: the dense values before they are repeated (:class:`FlatNorm`), or, where that
    declines, the rows whole (:class:`RowNorm`)."""
    c, u, requests, rows = layout.candidate_width, layout.user_width, len(counts), sum(counts)
    features = np.empty((rows, layout.width), dtype=np.float32)
    if not requests:
        return features
    flat_norm = layout.flat_norm
    normalised = None if flat_norm is None else flat_norm.apply(values, rows, requests)
    dense = values if normalised is None else normalised
    split = rows * c
    # What every candidate row of a request repeats: its user features, then its tag counts.
    shared = np.empty((requests, u + layout.tag_buckets), dtype=np.float32)
    shared[:, :u] = dense[split:].reshape(requests, u)
    shared[:, u:] = tag_block
    features[:, :c] = dense[:split].reshape(rows, c)
    features[:, c:] = np.repeat(shared, counts, axis=0)
    if normalised is None and layout.row_norm is not None:
        layout.row_norm.apply(features)
    return features


def prepare_alone(
    request: pb.InferRequest, layout: RankingLayout, payload: Buffer | None = None
) -> Prepared | None:
    """:func:`prepare_batch` of a batch of this one request, bit for bit, in about half the numpy calls
    (its user features and tag counts broadcast to its rows, nothing joined or counted by numpy); None for
    a request that the batch would drop (it says why). ``payload``: the request's own encoding."""
    r = request.ranking
    n = len(r.candidate_item_ids)
    c, u, buckets = layout.candidate_width, layout.user_width, layout.tag_buckets
    if not (
        0 < n <= layout.max_rows
        and r.candidate_feature_width == c
        and len(r.candidate_dense) == n * c
        and len(r.user_dense) == u
    ):
        return None
    candidate_dense, user_dense = dense_parts(r, payload)
    features = np.empty((n, layout.width), dtype=np.float32)
    features[:, :c] = _floats32(candidate_dense).reshape(n, c)
    features[:, c : c + u] = _floats32(user_dense)
    tags = r.categorical_tags
    if tags:
        counts = [0] * buckets
        known = tag_buckets(buckets)
        for tag in tags:
            counts[known[tag]] += 1
        features[:, c + u :] = counts
    else:
        features[:, c + u :] = 0
    if not np.logical_and.reduce(np.isfinite(features), axis=None):
        return None
    if layout.row_norm is not None:
        layout.row_norm.apply(features)
    inputs = {layout.input_name: features}
    ids = np.fromiter(r.candidate_item_ids, dtype=np.uint64, count=n)
    if layout.item_input:
        inputs[layout.item_input] = item_rows(ids, layout.item_table_rows).reshape(n, 1)
    return Prepared(
        inputs=inputs,
        extras={ITEM_IDS: ids, TOP_K: np.array([r.top_k], dtype=np.int64)},
        kept=[0],
        rows=[slice(0, n)],
        real_elements=int(features.size),
        padded_elements=int(features.size),
    )


def _dense_values(
    columns: RankingColumns, rankings: Sequence[pb.RankingFeatures], rows: int, layout: RankingLayout
) -> np.ndarray:
    """The requests' dense features as one flat float32 array: every candidate's (``rows`` x width), then
    every request's user features, in one copy.

    Their packed records joined, when those hold every value (the encoding as the serializer writes it:
    one packed record per field); else (values written unpacked, which the columns do not see) each
    request's read by :func:`dense_parts`."""
    c, u = layout.candidate_width, layout.user_width
    records = list(columns.candidate_dense)
    candidate = sum(map(len, records))
    records += columns.user_dense
    data = b"".join(records)
    if candidate != 4 * c * rows or len(data) != candidate + 4 * u * len(rankings):
        parts = [dense_parts(r) for r in rankings]
        return packed_floats32([p[0] for p in parts] + [p[1] for p in parts])
    return np.frombuffer(data, dtype=_FLOAT32_LE).astype(np.float32, copy=False)


def _tag_counts(columns: RankingColumns, rankings: Sequence[pb.RankingFeatures], buckets: int) -> np.ndarray:
    """How many of each request's tags fall in each bucket: (requests, buckets), int64. One bincount of
    (request number x buckets + the tag's bucket) over every tag; the buckets looked up by the tags'
    bytes (:class:`TagBuckets`)."""
    per_request = [len(r.categorical_tags) for r in rankings]
    tags: Sequence[bytes] = columns.categorical_tags
    total = sum(per_request)
    if len(tags) != total:  # not the requests' tags (never, for their own encodings): theirs, read one by one
        tags = [t.encode() for r in rankings for t in r.categorical_tags]
    bucket = np.fromiter(map(tag_buckets(buckets).__getitem__, tags), dtype=np.intp, count=total)
    bucket += np.repeat(np.arange(0, len(rankings) * buckets, buckets, dtype=np.intp), per_request)
    counts: np.ndarray = np.bincount(bucket, minlength=len(rankings) * buckets).reshape(
        len(rankings), buckets
    )
    return counts


def dense_parts(
    r: pb.RankingFeatures, payload: Buffer | None = None
) -> tuple[bytes | np.ndarray, bytes | np.ndarray]:
    """``candidate_dense`` and ``user_dense`` as packed little-endian float32 bytes, for numpy to read a
    whole batch of in one call (:func:`packed_floats32`).

    Read from the packed bytes of the message's serialization (proto/edgeinfer/v1/views.proto), or of
    ``payload``, the encoding of the ``InferRequest`` it came in: the serializer writes each field as one
    packed record, which numpy takes in one call, about ten times faster than converting the repeated
    field value by value. A payload whose last records do not hold every value (written unpacked, or in
    several records) is not read; a serialization whose do not (a field declared unpacked one day) falls
    back to the value-by-value read.
    """
    candidate_values, user_values = r.candidate_dense, r.user_dense
    if payload is not None:
        candidate, user = request_dense(payload)
        if len(candidate) == 4 * len(candidate_values) and len(user) == 4 * len(user_values):
            return candidate, user
    view = RankingDenseView.FromString(r.SerializeToString())
    return _packed(view.candidate_dense, candidate_values), _packed(view.user_dense, user_values)


def _packed(packed: bytes, values: Sequence[float]) -> bytes | np.ndarray:
    """A repeated float field's packed bytes when they hold every value, else the values read one by one."""
    if len(packed) == 4 * len(values):
        return packed
    return np.asarray(values, dtype=np.float32)


def _floats32(part: bytes | np.ndarray) -> np.ndarray:
    """One part of :func:`packed_floats32` as float32 values (little-endian: numpy converts on use)."""
    return np.frombuffer(part, dtype=_FLOAT32_LE) if isinstance(part, bytes) else part


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
    chosen positions of request ``i`` follow those of request ``i - 1``. One stable sort of one int64 key
    per candidate, (request, score descending), over the whole batch replaces a partition and a sort per
    request (~10 numpy calls each); float32 scores map to int32 in their order (NaN as -inf, -0.0 as
    0.0, which compare equal), the request above them. Other scores, or a negative ``top_k``:
    :func:`top_k_orders_sorted`.
    """
    chosen, wanted = _top_k_chosen(scores, counts, top_k)
    return chosen, np.asarray(wanted, dtype=np.int64)


def _top_k_chosen(
    scores: np.ndarray, counts: Sequence[int], top_k: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    """:func:`top_k_orders`, how many per request as a list."""
    wanted = np.asarray(top_k).tolist()
    if scores.dtype != np.float32 or (wanted and min(wanted) < 0):
        chosen, lengths = top_k_orders_sorted(scores, counts, top_k)
        return chosen, lengths.tolist()
    # NaN -> -inf; not np.fmax, which lets a signalling NaN through on short arrays (its scalar loop)
    keys = np.where(np.isnan(scores), -np.inf, scores)
    np.add(keys, 0.0, out=keys)  # -0.0 -> 0.0
    bits = keys.view(np.int32)
    flip = np.right_shift(bits, 31)  # -1 where negative: its magnitude bits flipped, the order turns over
    np.bitwise_and(flip, 0x7FFFFFFF, out=flip)
    np.bitwise_xor(bits, flip, out=bits)
    requests = len(counts)
    bases = _REQUEST_BASES[:requests] if requests <= len(_REQUEST_BASES) else _request_bases(requests)
    order: np.ndarray = np.argsort(np.subtract(np.repeat(bases, counts), bits), kind="stable")
    runs: list[int] = []
    for index, (n, k) in enumerate(zip(counts, wanted, strict=True)):
        keep = n if k == 0 or k > n else k
        wanted[index] = keep
        runs += (keep, n - keep)
    if wanted != counts:  # some requests cut: keep the first k of each request's n
        keep_drop = _KEEP_DROP[: 2 * requests] if 2 * requests <= len(_KEEP_DROP) else _keep_drop(requests)
        order = order[np.repeat(keep_drop, runs)]
    return order, wanted


def _request_bases(requests: int) -> np.ndarray:
    """Request ``i``'s part of the sort key: i * 2**32, above any score's int32 (negated)."""
    return np.left_shift(np.arange(requests, dtype=np.int64), 32)


def _keep_drop(requests: int) -> np.ndarray:
    """True, False per request: repeated by (kept, dropped) counts, the mask of each request's top-k."""
    return np.tile(np.array([True, False]), requests)


_REQUEST_BASES: Final = _request_bases(4096)
_KEEP_DROP: Final = _keep_drop(4096)


def top_k_orders_sorted(
    scores: np.ndarray, counts: Sequence[int], top_k: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`top_k_orders` by a lexsort of (request, score descending): any scores."""
    n = np.asarray(counts, dtype=np.int64)
    keys = np.where(np.isnan(scores), -np.inf, scores)
    request = np.repeat(np.arange(len(n)), n)
    order = np.lexsort((-keys, request))  # stable: equal keys stay in position order
    k = np.asarray(top_k, dtype=np.int64)
    wanted = np.where(k == 0, n, np.minimum(k, n))
    rank = np.arange(len(order)) - np.repeat(np.cumsum(n) - n, n)
    chosen: np.ndarray = order[rank < np.repeat(wanted, n)]
    return chosen, wanted


def top_k_order(scores: np.ndarray, k: int) -> np.ndarray:
    """:func:`top_k_orders` of a batch of one request (all of ``scores``), in one sort: its ``k`` (0 = all)
    highest positions, highest first, equal scores in position order, NaN last."""
    # NaN -> -inf, as in top_k_orders; not np.fmax, which lets a signalling NaN through on short arrays
    keys = np.where(np.isnan(scores), -np.inf, scores)
    np.negative(keys, out=keys)
    order: np.ndarray = np.argsort(keys, kind="stable")
    return order[:k] if 0 < k < len(order) else order


def _finite_requests(
    candidate_block: np.ndarray,
    user_block: np.ndarray,
    kept: list[int],
    counts: list[int],
    rejected: dict[int, tuple[str, str]],
) -> np.ndarray | None:
    """None when every request's dense features are finite; else which requests' are (a bool per kept
    request), those holding a NaN or an infinity put in ``rejected`` as ``bad_features``: a model scores
    them as garbage, and the normalisation would compute with them. One pass over each block; the rest
    only when one is found."""
    if np.isfinite(candidate_block).all() and np.isfinite(user_block).all():
        return None  # the usual case: two flat passes, no per row
    finite_rows = np.isfinite(candidate_block).all(axis=1)
    finite_users = np.isfinite(user_block).all(axis=1)
    sizes = np.asarray(counts, dtype=np.int64)
    finite_candidates = np.logical_and.reduceat(finite_rows, np.cumsum(sizes) - sizes)
    good: np.ndarray = finite_candidates & finite_users
    for number in np.flatnonzero(~good).tolist():
        field = "candidate_dense" if not finite_candidates[number] else "user_dense"
        rejected[kept[number]] = (
            InvalidInput.BAD_FEATURES,
            f"{field} holds NaN or infinity; every feature value must be finite",
        )
    return good


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
