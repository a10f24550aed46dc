"""The synthetic traffic is deterministic, covers every kind and region, and looks like real traffic."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from edge_agent.synthetic import PROFILES, SyntheticTraffic
from edgewire import is_valid_id, pb

N = 1500


@pytest.fixture(scope="module")
def traffic() -> list[pb.InferRequest]:
    return [r.request for r in SyntheticTraffic(5).take(N)]


def test_same_seed_same_bytes() -> None:
    """Two generators with one seed produce identical serialized requests."""
    a = [r.request.SerializeToString() for r in SyntheticTraffic(9).take(200)]
    b = [r.request.SerializeToString() for r in SyntheticTraffic(9).take(200)]
    assert a == b
    assert a != [r.request.SerializeToString() for r in SyntheticTraffic(10).take(200)]


def test_every_kind_priority_and_region_appears() -> None:
    """All request kinds, priority classes and the six regions occur in a few thousand requests."""
    reqs = SyntheticTraffic(5).take(N)
    assert {r.request.kind for r in reqs} == {
        pb.REQUEST_KIND_RANKING,
        pb.REQUEST_KIND_TEXT,
        pb.REQUEST_KIND_IMAGE,
    }
    assert {r.request.priority for r in reqs} == {
        pb.PRIORITY_CLASS_REALTIME,
        pb.PRIORITY_CLASS_INTERACTIVE,
        pb.PRIORITY_CLASS_BATCH,
    }
    assert {r.region for r in reqs} == {p.name for p in PROFILES}
    assert {"ap-southeast-1", "ap-northeast-1", "us-west", "us-east", "eu-central", "eu-west"} <= {
        p.name for p in PROFILES
    }


def test_region_filter() -> None:
    """An agent's generator yields only its own region."""
    assert {r.region for r in SyntheticTraffic(1, regions=("us-west",)).take(200)} == {"us-west"}
    with pytest.raises(ValueError, match="unknown regions"):
        SyntheticTraffic(1, regions=("mars-1",))


def test_ids_are_uuid7_and_time_ordered() -> None:
    """Request ids are valid, unique UUIDv7 whose timestamps follow arrival order."""
    reqs = SyntheticTraffic(2).take(500)
    ids = [r.request.request_id for r in reqs]
    assert all(is_valid_id(i) for i in ids)
    assert len(set(ids)) == len(ids)
    stamps = [int.from_bytes(i[:6], "big") for i in ids]
    assert stamps == sorted(stamps)


def test_item_popularity_is_zipf(traffic: list[pb.InferRequest]) -> None:
    """A few items take a large share of candidate slots: the head is far above the median item."""
    counts = Counter(
        i for r in traffic if r.kind == pb.REQUEST_KIND_RANKING for i in r.ranking.candidate_item_ids
    )
    freq = np.array(sorted(counts.values(), reverse=True))
    assert freq[0] > 50 * np.median(freq)
    assert freq[:100].sum() > 0.15 * freq.sum()


def test_ranking_candidates_tens_to_hundreds(traffic: list[pb.InferRequest]) -> None:
    """Ranking requests carry 10..500 candidates with one feature row each."""
    sizes = [len(r.ranking.candidate_item_ids) for r in traffic if r.kind == pb.REQUEST_KIND_RANKING]
    assert min(sizes) >= 10
    assert 200 <= max(sizes) <= 500
    for r in traffic[:200]:
        if r.kind == pb.REQUEST_KIND_RANKING:
            ranking = r.ranking
            assert (
                len(ranking.candidate_dense)
                == len(ranking.candidate_item_ids) * ranking.candidate_feature_width
            )


def test_feature_values_repeat_like_a_catalog(traffic: list[pb.InferRequest]) -> None:
    """Dense features are quantised catalog values, not uniform random floats."""
    values = np.array(
        [v for r in traffic if r.kind == pb.REQUEST_KIND_RANKING for v in r.ranking.candidate_dense]
    )
    assert len(np.unique(values)) < 0.1 * len(values)


def test_images_are_real_jpegs_of_the_declared_size(traffic: list[pb.InferRequest]) -> None:
    """Image requests decode with Pillow to their declared width and height, in several sizes."""
    images = [r.image for r in traffic if r.kind == pb.REQUEST_KIND_IMAGE]
    assert len({(i.width, i.height) for i in images}) >= 3
    for image in images[:20]:
        decoded = Image.open(io.BytesIO(image.data))
        assert decoded.format == "JPEG"
        assert decoded.size == (image.width, image.height)


def test_text_queries_repeat_and_span_languages(traffic: list[pb.InferRequest]) -> None:
    """Search queries follow a popular head (repeats) across several locales."""
    texts = [r.text for r in traffic if r.kind == pb.REQUEST_KIND_TEXT]
    queries = Counter(t.text for t in texts)
    assert queries.most_common(1)[0][1] >= 3
    assert len({t.locale.split("-")[0] for t in texts}) >= 5


def test_deadlines_follow_priority_class() -> None:
    """Realtime budgets are tighter than interactive, which are tighter than batch."""
    budgets: dict[int, list[int]] = {}
    for r in SyntheticTraffic(4).take(600):
        budgets.setdefault(r.request.priority, []).append(r.budget_ms)
    assert max(budgets[pb.PRIORITY_CLASS_REALTIME]) < min(budgets[pb.PRIORITY_CLASS_INTERACTIVE]) + 1000
    assert max(budgets[pb.PRIORITY_CLASS_INTERACTIVE]) < min(budgets[pb.PRIORITY_CLASS_BATCH])
