"""The torch backend's config, and its failure without PyTorch (the GPU path runs in bench/gpu_tier.py)."""

from __future__ import annotations

import importlib.util

import pytest

from gateway.backends.torch import TorchBackend, TorchOptions
from inference.backends.base import BackendHealth, create


def test_options_are_read_with_defaults() -> None:
    """Models map names to factories; fp16 on cuda:0 with two threads unless told otherwise."""
    options = TorchOptions.from_mapping("gpu", {"models": {"bert-base": "gateway.models.gpu:bert_base"}})
    assert (options.device, options.dtype, options.threads) == ("cuda:0", "float16", 2)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({}, "models"),
        ({"models": {"m": "no_colon"}}, "models"),
        ({"models": {"m": "a:b"}, "dtype": "int8"}, "dtype"),
        ({"models": {"m": "a:b"}, "device": "tpu"}, "device"),
        ({"models": {"m": "a:b"}, "threads": 0}, "threads"),
        ({"models": {"m": "a:b"}, "gpus": 2}, "gpus"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        create("torch", "gpu", options)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="checks the error without PyTorch")
async def test_start_without_pytorch_is_a_clear_error() -> None:
    """A gateway configured with a torch backend on a host without PyTorch fails to start, saying why."""
    backend = TorchBackend("gpu", TorchOptions.from_mapping("gpu", {"models": {"m": "a:b"}}))
    with pytest.raises(RuntimeError, match="needs PyTorch"):
        await backend.start()
    assert backend.health() is BackendHealth.NOT_SERVING
    await backend.aclose()
    await backend.aclose()
