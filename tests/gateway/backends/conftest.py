"""The remote backends' tests compare against the embedded ONNX backend: its fixtures, shared with
tests/inference/backends (where that backend's own tests live)."""

from tests.inference.backends.conftest import backend, repository

__all__ = ["backend", "repository"]
