"""Pipelines by name."""

from __future__ import annotations

import pytest

from inference.pipeline.registry import PIPELINE_NAMES, REJECT_LABELS, pipeline_for


@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_each_name_gives_its_pipeline(name: str) -> None:
    """pipeline_for(name) is the pipeline of that kind, one shared instance per name."""
    assert pipeline_for(name).kind == name
    assert pipeline_for(name) is pipeline_for(name)


def test_unknown_name_is_refused() -> None:
    """An unknown pipeline name is a ValueError listing the known ones."""
    with pytest.raises(ValueError, match="known: \\['ranking'"):
        pipeline_for("audio")


def test_reject_labels_are_the_documented_ones() -> None:
    """The labels a metric pre-registers include the four the pipelines are specified with."""
    assert {"bad_features", "empty_text", "bad_image", "size_mismatch"} <= set(REJECT_LABELS)
