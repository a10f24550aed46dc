"""Fixtures for backend tests: the demo model repository on disk and a started ONNX backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.models import write_demo_repository


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """The demo model repository, version 1 of each model."""
    root = tmp_path / "models"
    write_demo_repository(root)
    return root


@pytest.fixture
async def backend(repository: Path) -> AsyncIterator[OnnxBackend]:
    """A started ONNX backend on the demo repository, without periodic rescans."""
    onnx = OnnxBackend("cpu", OnnxOptions(repository=repository, rescan_interval_s=0))
    await onnx.start()
    yield onnx
    await onnx.aclose()
