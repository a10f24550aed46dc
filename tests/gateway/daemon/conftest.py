"""Fixtures for tests that drive a real gateway on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.models.demo import write_demo_repository


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model repository, written once per session."""
    root = tmp_path_factory.mktemp("models")
    write_demo_repository(root)
    return root
