"""Test helper: the ModelSpec of a demo model, as a backend would report it."""

from __future__ import annotations

from pathlib import Path

from inference.backends.base import ModelSpec
from inference.backends.modelrepo import spec_from_config
from inference.models import demo_config


def demo_spec(model: str) -> ModelSpec:
    """The version-1 spec of one demo model, straight from its config."""
    return spec_from_config(demo_config(model), "1", Path(model) / "config.pbtxt")
