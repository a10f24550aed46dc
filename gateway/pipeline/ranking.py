"""Ranking requests -> one feature row per candidate -> the top-k candidates by score.

A row is ``[candidate_dense | user_dense | tag buckets]``: the candidate's own features, then the request's
user features and hashed categorical tags, repeated on every candidate row of the request. A batch
concatenates the rows of its requests; the model scores each row independently. The widths come from the
model's parameters (``candidate_feature_width``, ``user_feature_width``, ``tag_buckets``) and must add up to
the model's feature width.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgewire import pb
from gateway.backends.base import ModelSpec
from gateway.pipeline.base import Prepared
from gateway.pipeline.tensor import InvalidInput, batch_slices, kept_requests, tensor_from_array

SCORES = "scores"
ITEM_IDS = "item_ids"


@dataclass(frozen=True, slots=True)
class RankingLayout:
    """Where each feature group sits in a row, read from a model's spec."""

    input_name: str
    candidate_width: int
    user_width: int
    tag_buckets: int
    max_rows: int

    @classmethod
    def of(cls, spec: ModelSpec) -> RankingLayout:
        """The layout of a ranking model; a spec whose widths do not add up is a ValueError."""
        (features,) = spec.inputs
        params = spec.parameters
        layout = cls(
            input_name=features.name,
            candidate_width=int(params.get("candidate_feature_width", "8")),
            user_width=int(params.get("user_feature_width", "16")),
            tag_buckets=int(params.get("tag_buckets", "16")),
            max_rows=spec.max_batch_size,
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
        candidates: list[np.ndarray] = []
        users: list[np.ndarray] = []
        tags: list[np.ndarray] = []
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
            candidates.append(np.asarray(r.candidate_dense, dtype=np.float32))
            users.append(np.asarray(r.user_dense, dtype=np.float32))
            buckets = [tag_bucket(tag, layout.tag_buckets) for tag in r.categorical_tags]
            tags.append(np.bincount(np.asarray(buckets, dtype=np.intp), minlength=layout.tag_buckets))
            counts.append(n)
            kept.append(index)
        rows = int(sum(counts))
        features = np.empty((rows, layout.width), dtype=np.float32)
        if kept:
            c, u = layout.candidate_width, layout.user_width
            repeats = np.asarray(counts)
            features[:, :c] = np.concatenate(candidates).reshape(rows, c)
            features[:, c : c + u] = np.repeat(np.stack(users), repeats, axis=0)
            features[:, c + u :] = np.repeat(np.stack(tags), repeats, axis=0)
        return Prepared(
            inputs={layout.input_name: features},
            kept=kept,
            rows=batch_slices(counts),
            rejected=rejected,
            real_elements=int(features.size),
            padded_elements=int(features.size),
        )

    def finish(
        self, prepared: Prepared, outputs: Mapping[str, np.ndarray], requests: Sequence[pb.InferRequest]
    ) -> list[list[pb.Tensor]]:
        """Per kept request, its candidates ordered by score, best first, cut to ``top_k`` (0 = all).

        ``requests`` may be the whole batch given to ``prepare`` or only the kept requests.
        """
        scores = np.asarray(outputs[SCORES], dtype=np.float32).reshape(-1)
        results: list[list[pb.Tensor]] = []
        for request, rows in zip(kept_requests(prepared, requests), prepared.rows, strict=True):
            r = request.ranking
            own = scores[rows]
            order = top_k_order(own, r.top_k)
            item_ids = np.asarray(r.candidate_item_ids, dtype=np.uint64)[order]
            results.append([tensor_from_array(ITEM_IDS, item_ids), tensor_from_array(SCORES, own[order])])
        return results


def top_k_order(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` highest scores (0 = all), highest first; equal scores keep position order.

    ``argpartition`` finds the k-th highest value without a full sort; everything above it, and the
    earliest positions equal to it, make the cut, which is then sorted. NaN ranks last.
    """
    n = len(scores)
    k = n if k == 0 else min(k, n)
    if k == 0:
        return np.zeros(0, dtype=np.intp)
    keys = np.where(np.isnan(scores), -np.inf, scores)
    if k < n:
        threshold = keys[np.argpartition(-keys, k - 1)[k - 1]]
        above = np.flatnonzero(keys > threshold)
        equal = np.flatnonzero(keys == threshold)[: k - len(above)]
        chosen = np.concatenate([above, equal])
    else:
        chosen = np.arange(n)
    return chosen[np.lexsort((chosen, -keys[chosen]))]


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
