"""Shared fixtures: hypothesis profiles bounded for CI, the demo model repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Before anything imports onnxruntime (inference.models.demo does): no telemetry files under ~/.cache.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

from inference.models.demo import write_demo_repository

settings.register_profile(
    "ci", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model repository, written once per session (tests only read it)."""
    root = tmp_path_factory.mktemp("models")
    write_demo_repository(root)
    return root
