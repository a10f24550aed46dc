"""hk-gateway check-config warns about a pool that batches more requests than one of its models takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.cli import main
from inference.models import write_demo_repository


def write_config(tmp_path: Path, cpu_max_batch: int) -> Path:
    """A gateway config serving the demo repository under ``tmp_path`` on every pool; the CPU pool
    batches ``cpu_max_batch`` requests (the demo image-classifier takes 32, text-encoder 64)."""
    repository = tmp_path / "models"
    if not repository.exists():
        write_demo_repository(repository)
    path = tmp_path / "gateway.toml"
    pools = "".join(
        f'[pools.{name}]\nbackend = "embedded"\n' for name in ("gpu-a100", "gpu-a100-mig", "gpu-v100")
    )
    path.write_text(
        '[security]\nmode = "plaintext"\n'
        f'[backends.embedded]\ntype = "onnx"\nrepository = "{repository}"\n'
        f'[pools.cpu]\nbackend = "embedded"\nmax_batch_size = {cpu_max_batch}\n{pools}'
    )
    return path


def test_a_pool_batching_more_than_a_model_takes_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """max_batch_size 64 on the CPU pool, whose image-classifier takes 32: exit 0 (the pool cuts that
    model's batches at 32), one warning naming the pool key, the model, its limit and its config file."""
    path = write_config(tmp_path, 64)
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert re.fullmatch(
        rf"{re.escape(str(path))}: warning: pools\.cpu\.max_batch_size: 64, but model image-classifier "
        r"takes at most 32 \(.*image-classifier/config\.pbtxt\); its batches are cut at 32",
        err[0],
    ), err[0]


def test_a_model_that_does_not_batch_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose config.pbtxt says max_batch_size 0 is served one request per call: said so."""
    path = write_config(tmp_path, 32)
    config = tmp_path / "models" / "rank-mlp" / "config.pbtxt"
    config.write_text(re.sub(r"max_batch_size: \d+", "max_batch_size: 0", config.read_text()))
    assert main(["check-config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "pools.cpu.max_batch_size: 32, but model rank-mlp does not batch" in err, err
    assert "its batches are cut at 1" in err


def test_pools_within_their_models_limits_pass_quietly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every pool at 32, the smallest model limit: no warning."""
    path = write_config(tmp_path, 32)
    assert main(["check-config", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert ": OK (" in captured.out
