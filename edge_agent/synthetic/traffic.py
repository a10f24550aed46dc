"""Realistic synthetic cross-border e-commerce inference traffic, deterministic under a seed.

Three request kinds, as the Hong Kong models see them:

* ranking (``rank-mlp``): a home-feed / PDP / email recommender scores tens to hundreds of candidates that
  a retrieval stage picked; item popularity is Zipf, per-item features are the catalog's (prices ending in
  .99, discounts in 5 % steps, ratings to one decimal), so popular items repeat byte for byte across requests;
* text (``text-encoder``, BERT-class): search queries from a Zipf head of product queries per language, and
  catalog descriptions for batch embedding jobs;
* image (``image-classifier``, ResNet-class): visual-search uploads and catalog shots as real JPEGs.

Regions differ in share, languages, devices and delivery times (see ``regions.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, TypeVar

import numpy as np

from edge_agent.synthetic.images import pick_size, product_photo
from edge_agent.synthetic.regions import PROFILE_BY_NAME, PROFILES, RegionProfile
from edge_agent.synthetic.vocab import DESCRIPTION_TEMPLATES, UNSPACED, VOCAB
from edgewire.ids import id_from_parts
from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb

MODEL_RANKING: Final = "rank-mlp"
MODEL_TEXT: Final = "text-encoder"
MODEL_IMAGE: Final = "image-classifier"

CANDIDATE_FEATURES: Final = (
    "price",
    "discount",
    "rating",
    "log_reviews",
    "ctr_7d",
    "in_stock",
    "ship_days",
    "cross_border",
)
USER_FEATURE_WIDTH: Final = 16
DEFAULT_START_UNIX_MS: Final = 1_795_000_000_000  # 2026-11-18, a fixed epoch so ids are reproducible

# Share of requests by kind, and of each kind by priority class, with the deadline budget of each class.
KIND_MIX: Final = (
    (pb.REQUEST_KIND_RANKING, 0.60),
    (pb.REQUEST_KIND_TEXT, 0.32),
    (pb.REQUEST_KIND_IMAGE, 0.08),
)
PRIORITY_MIX: Final = {
    pb.REQUEST_KIND_RANKING: (
        (pb.PRIORITY_CLASS_REALTIME, 0.55),
        (pb.PRIORITY_CLASS_INTERACTIVE, 0.30),
        (pb.PRIORITY_CLASS_BATCH, 0.15),
    ),
    pb.REQUEST_KIND_TEXT: (
        (pb.PRIORITY_CLASS_REALTIME, 0.60),
        (pb.PRIORITY_CLASS_INTERACTIVE, 0.35),
        (pb.PRIORITY_CLASS_BATCH, 0.05),
    ),
    pb.REQUEST_KIND_IMAGE: ((pb.PRIORITY_CLASS_INTERACTIVE, 0.65), (pb.PRIORITY_CLASS_BATCH, 0.35)),
}
BUDGET_MS: Final = {
    pb.PRIORITY_CLASS_REALTIME: (120, 300),
    pb.PRIORITY_CLASS_INTERACTIVE: (400, 1500),
    pb.PRIORITY_CLASS_BATCH: (30_000, 120_000),
}
TENANTS: Final = {
    (pb.REQUEST_KIND_RANKING, pb.PRIORITY_CLASS_REALTIME): ("home-feed", "pdp-similar", "cart-addons"),
    (pb.REQUEST_KIND_RANKING, pb.PRIORITY_CLASS_INTERACTIVE): ("search-rerank", "category-page"),
    (pb.REQUEST_KIND_RANKING, pb.PRIORITY_CLASS_BATCH): ("email-reco", "push-reco"),
    (pb.REQUEST_KIND_TEXT, pb.PRIORITY_CLASS_REALTIME): ("search-suggest", "search"),
    (pb.REQUEST_KIND_TEXT, pb.PRIORITY_CLASS_INTERACTIVE): ("search", "support-bot"),
    (pb.REQUEST_KIND_TEXT, pb.PRIORITY_CLASS_BATCH): ("catalog-indexer",),
    (pb.REQUEST_KIND_IMAGE, pb.PRIORITY_CLASS_INTERACTIVE): ("visual-search",),
    (pb.REQUEST_KIND_IMAGE, pb.PRIORITY_CLASS_BATCH): ("catalog-indexer",),
}
# Candidates per ranking request by class: (median, sigma of the log, min, max).
CANDIDATES: Final = {
    pb.PRIORITY_CLASS_REALTIME: (50, 0.6, 10, 300),
    pb.PRIORITY_CLASS_INTERACTIVE: (120, 0.5, 20, 400),
    pb.PRIORITY_CLASS_BATCH: (300, 0.3, 100, 500),
}
T = TypeVar("T")
CATEGORIES: Final = ("electronics", "fashion", "beauty", "home", "sports", "toys", "grocery", "auto")


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    """One generated request with where and when it arises."""

    region: str
    offset_s: float  # arrival time after the start of the run (Poisson process at the given rate)
    budget_ms: int  # deadline budget of the caller; request.deadline_unix_us = arrival + budget
    request: pb.InferRequest


class ZipfSampler:
    """Bounded Zipf over ranks 0..n-1 with exponent s, by inverse CDF (vectorised)."""

    def __init__(self, n: int, s: float) -> None:
        weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
        self._cdf = np.cumsum(weights / weights.sum())

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self._cdf, rng.random(size)), len(self._cdf) - 1)


class Catalog:
    """Items ordered by popularity rank, with the features a ranking model reads per candidate."""

    def __init__(self, rng: np.random.Generator, n_items: int) -> None:
        self.item_ids = (rng.permutation(n_items).astype(np.uint64) * np.uint64(7919)) + np.uint64(10_000_000)
        self.category = rng.integers(0, len(CATEGORIES), n_items)
        price = np.round(np.exp(rng.normal(3.2, 0.9, n_items))) - 0.01
        features = np.empty((n_items, len(CANDIDATE_FEATURES)), dtype=np.float32)
        features[:, 0] = np.clip(price, 0.99, 2999.99)
        features[:, 1] = rng.choice([0.0, 0.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5], n_items)
        features[:, 2] = np.round(np.clip(rng.normal(4.4, 0.35, n_items), 1.0, 5.0), 1)
        popularity = 1.0 / np.arange(1, n_items + 1) ** 0.8
        features[:, 3] = np.round(np.log1p(popularity * 2e5 * rng.uniform(0.5, 1.5, n_items)), 2)
        features[:, 4] = np.round(
            np.clip(0.01 + 0.08 * popularity**0.3 * rng.uniform(0.6, 1.2, n_items), 0.001, 0.5), 4
        )
        features[:, 5] = (rng.random(n_items) > 0.04).astype(np.float32)
        features[:, 6] = 0.0  # filled per region at request time
        features[:, 7] = (rng.random(n_items) < 0.7).astype(np.float32)
        self.features = features
        self.popularity = ZipfSampler(n_items, 1.05)


class UserBase:
    """A region's shoppers: Zipf activity, quantised profile features."""

    def __init__(self, rng: np.random.Generator, n_users: int) -> None:
        self.activity = ZipfSampler(n_users, 0.9)
        f = np.zeros((n_users, USER_FEATURE_WIDTH), dtype=np.float32)
        f[:, 0] = rng.integers(0, 7, n_users)  # age bucket
        f[:, 1] = rng.integers(0, 3, n_users)  # gender (incl. unknown)
        f[:, 2] = rng.integers(0, 5, n_users)  # spend tier
        f[:, 3] = rng.geometric(0.03, n_users).clip(0, 365)  # days since last order
        f[:, 4] = rng.poisson(2.0, n_users)  # orders in 90 days
        f[:, 5] = np.round(rng.lognormal(3.5, 0.6, n_users) * 2) / 2  # average basket, 0.5 steps
        f[:, 6] = (rng.random(n_users) < 0.3).astype(np.float32)  # member
        f[:, 7:15] = np.round(rng.dirichlet(np.ones(len(CATEGORIES)) * 0.5, n_users), 2)  # category affinity
        f[:, 15] = rng.integers(0, 24, n_users)  # usual hour of visit
        self.features = f


def _weighted(rng: np.random.Generator, options: tuple[tuple[T, float], ...]) -> T:
    weights = np.array([w for _, w in options])
    return options[int(rng.choice(len(options), p=weights / weights.sum()))][0]


class SyntheticTraffic:
    """Deterministic generator: the same seed and arguments give the same requests, byte for byte."""

    def __init__(
        self,
        seed: int = 0,
        *,
        regions: tuple[str, ...] | None = None,
        rate_per_s: float = 1000.0,
        start_unix_ms: int = DEFAULT_START_UNIX_MS,
        n_items: int = 200_000,
        n_users: int = 20_000,
        kind_mix: tuple[tuple[pb.RequestKind.ValueType, float], ...] = KIND_MIX,
    ) -> None:
        unknown = [r for r in regions or () if r not in PROFILE_BY_NAME]
        if unknown:
            raise ValueError(f"unknown regions {unknown}; known: {sorted(PROFILE_BY_NAME)}")
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        self._rng = np.random.default_rng(seed)
        world = np.random.default_rng([seed, 1])  # the catalog and users do not depend on the region filter
        self.catalog = Catalog(world, n_items)
        self.profiles = tuple(PROFILE_BY_NAME[r] for r in regions) if regions else PROFILES
        self._users = {
            p.name: UserBase(np.random.default_rng([seed, 2, i]), n_users)
            for i, p in enumerate(PROFILES)
            if p in self.profiles
        }
        self._queries = {
            lang: self._query_head(np.random.default_rng([seed, 3, i]), lang)
            for i, lang in enumerate(sorted(VOCAB))
        }
        self._query_rank = ZipfSampler(len(next(iter(self._queries.values()))), 1.0)
        self.rate_per_s = rate_per_s
        self.start_unix_ms = start_unix_ms
        self._kind_mix = kind_mix
        self._offset_s = 0.0

    # ------------------------------------------------------------------ public

    def take(self, n: int) -> list[SyntheticRequest]:
        """The next n requests."""
        return [self.next() for _ in range(n)]

    def __iter__(self) -> Iterator[SyntheticRequest]:
        while True:
            yield self.next()

    def next(self) -> SyntheticRequest:
        rng = self._rng
        self._offset_s += float(rng.exponential(1.0 / self.rate_per_s))
        profile = self.profiles[int(rng.choice(len(self.profiles), p=self._region_weights()))]
        kind = _weighted(rng, self._kind_mix)
        priority = _weighted(rng, PRIORITY_MIX[kind])
        lo, hi = BUDGET_MS[priority]
        budget_ms = int(rng.integers(lo, hi + 1))
        arrival_ms = self.start_unix_ms + int(self._offset_s * 1000)
        tenants = TENANTS[(kind, priority)]
        req = pb.InferRequest(
            request_id=id_from_parts(
                arrival_ms, int(rng.integers(0, 1 << 62)) << 12 | int(rng.integers(0, 4096))
            ),
            kind=kind,
            priority=priority,
            deadline_unix_us=(arrival_ms + budget_ms) * 1000,
            tenant=tenants[int(rng.integers(len(tenants)))],
        )
        if kind == pb.REQUEST_KIND_RANKING:
            self._ranking(req, profile, priority)
        elif kind == pb.REQUEST_KIND_TEXT:
            self._text(req, profile, priority)
        else:
            self._image(req)
        return SyntheticRequest(profile.name, self._offset_s, budget_ms, req)

    # ------------------------------------------------------------------ kinds

    def _ranking(
        self, req: pb.InferRequest, profile: RegionProfile, priority: pb.PriorityClass.ValueType
    ) -> None:
        rng = self._rng
        median, sigma, lo, hi = CANDIDATES[priority]
        n = int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))
        ranks = self.catalog.popularity.sample(rng, n)
        ranks = ranks[np.sort(np.unique(ranks, return_index=True)[1])]  # retrieval returns each item once
        dense = self.catalog.features[ranks].copy()
        ship_lo, ship_hi = profile.ship_days
        dense[:, 6] = ship_lo + (ranks % (ship_hi - ship_lo + 1))
        users = self._users[profile.name]
        user = int(users.activity.sample(rng, 1)[0])
        device = _weighted(rng, profile.devices)
        locale = _weighted(rng, profile.locales)
        category = CATEGORIES[int(np.bincount(self.catalog.category[ranks[:8]]).argmax())]
        req.model_name = MODEL_RANKING
        r = req.ranking
        r.user_id = f"u{profile.name[:2]}{user:07d}"
        r.session_id = f"s{int(rng.integers(0, 1 << 40)):010x}"
        r.candidate_item_ids.extend(self.catalog.item_ids[ranks].tolist())
        r.candidate_dense.extend(dense.ravel().tolist())
        r.candidate_feature_width = dense.shape[1]
        r.user_dense.extend(users.features[user].tolist())
        r.categorical_tags.extend(
            [
                f"device:{device}",
                f"locale:{locale}",
                f"currency:{profile.currency}",
                f"cat:{category}",
                f"page:{req.tenant}",
                f"ab:rank-v7-{'ab'[user % 2]}",
            ]
        )
        r.top_k = 20 if priority != pb.PRIORITY_CLASS_BATCH else 50
        if rng.random() < 0.05:
            req.complexity_hint = 0.8  # a caller that knows its re-rank is heavy

    def _text(
        self, req: pb.InferRequest, profile: RegionProfile, priority: pb.PriorityClass.ValueType
    ) -> None:
        rng = self._rng
        locale = _weighted(rng, profile.locales)
        lang = locale.split("-")[0]
        req.model_name = MODEL_TEXT
        if priority == pb.PRIORITY_CLASS_BATCH:
            words = VOCAB["en"]
            parts = [
                DESCRIPTION_TEMPLATES[int(rng.integers(len(DESCRIPTION_TEMPLATES)))].format(
                    brand=words["brands"][int(rng.integers(len(words["brands"])))],
                    noun=words["nouns"][int(rng.integers(len(words["nouns"])))],
                    mod=words["mods"][int(rng.integers(len(words["mods"])))],
                )
                for _ in range(int(rng.integers(2, 6)))
            ]
            req.text.text = " ".join(parts)
            req.text.locale = "en-US"
            return
        queries = self._queries[lang]
        req.text.text = queries[int(self._query_rank.sample(rng, 1)[0])]
        req.text.locale = locale

    def _image(self, req: pb.InferRequest) -> None:
        rng = self._rng
        width, height = pick_size(rng)
        req.model_name = MODEL_IMAGE
        req.image.data = product_photo(np.random.default_rng(int(rng.integers(0, 1 << 62))), width, height)
        req.image.format = pb.IMAGE_FORMAT_JPEG
        req.image.width = width
        req.image.height = height

    # ------------------------------------------------------------------ helpers

    def _region_weights(self) -> np.ndarray:
        shares = np.array([p.share for p in self.profiles])
        weights: np.ndarray = shares / shares.sum()
        return weights

    @staticmethod
    def _query_head(rng: np.random.Generator, lang: str, size: int = 3000) -> list[str]:
        """A language's query log head, most popular first: [brand] noun [modifiers]."""
        words = VOCAB[lang]
        sep = "" if lang in UNSPACED else " "
        queries: list[str] = []
        seen: set[str] = set()
        while len(queries) < size:
            parts = []
            if rng.random() < 0.4:
                parts.append(words["brands"][int(rng.integers(len(words["brands"])))])
            parts.append(words["nouns"][int(rng.integers(len(words["nouns"])))])
            for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
                parts.append(words["mods"][int(rng.integers(len(words["mods"])))])
            query = sep.join(parts)
            if query not in seen or len(seen) > size * 4:
                seen.add(query)
                queries.append(query)
        return queries
