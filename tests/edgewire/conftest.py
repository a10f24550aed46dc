"""Fixtures for the codec tests: a dictionary trained on synthetic traffic."""

from __future__ import annotations

import pytest

from edge_agent.synthetic import SyntheticTraffic
from edgewire import DictionaryStore, pb
from edgewire.dictionaries import train


@pytest.fixture(scope="session")
def trained_dictionary() -> bytes:
    """A small dictionary trained on synthetic ranking and text requests."""
    samples = [
        pb.RequestBatch(requests=[r.request]).SerializeToString()
        for r in SyntheticTraffic(3, n_items=5000, n_users=500).take(400)
        if r.request.kind != pb.REQUEST_KIND_IMAGE
    ]
    return train(samples, 16 * 1024)


@pytest.fixture
def store(trained_dictionary: bytes) -> DictionaryStore:
    """A store holding the trained dictionary (preferred)."""
    return DictionaryStore.from_raw([trained_dictionary])
