"""The Triton repository generator: deploy/triton matches it, configs carry the production settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.models.triton import config_text, triton_config
from inference.backends.modelrepo import load_model_config, spec_from_config
from inference.models.demo import DEMO_MODELS

DEPLOY = Path(__file__).parents[3] / "deploy" / "triton"


@pytest.mark.parametrize("kind", ["gpu", "cpu"])
@pytest.mark.parametrize("model", DEMO_MODELS)
def test_deploy_configs_are_what_the_generator_writes(kind: str, model: str) -> None:
    """deploy/triton/<kind>/<model>/config.pbtxt equals the generator's output (regenerate on a change)."""
    committed = (DEPLOY / kind / model / "config.pbtxt").read_text()
    assert committed == config_text(triton_config(model, kind=kind)), (
        f"run: hk-gateway models init --triton {kind}"
    )


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_configs_have_priorities_bounded_queue_and_deadline_override(model: str) -> None:
    """Each config batches on the server, has 3 priority levels, REJECTs and lets requests bring a timeout."""
    config = load_model_config(DEPLOY / "gpu" / model / "config.pbtxt")
    batching = config.dynamic_batching
    assert spec_from_config(config, "1", DEPLOY).server_batching
    assert batching.priority_levels == 3 and batching.preferred_batch_size
    policy = batching.default_queue_policy
    assert policy.allow_timeout_override and policy.default_timeout_microseconds > 0
    assert policy.max_queue_size > 0 and policy.timeout_action == 0  # REJECT
    assert config.instance_group[0].kind == 1  # KIND_GPU
    assert config.version_policy.latest.num_versions == 2


def test_cli_writes_a_python_runtime_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`models init --triton cpu --runtime python --versions 2` writes configs, models and the shim."""
    assert (
        main(["models", "init", str(tmp_path), "--triton", "cpu", "--runtime", "python", "--versions", "2"])
        == 0
    )
    for model in DEMO_MODELS:
        config = load_model_config(tmp_path / model / "config.pbtxt")
        assert config.backend == "python" and config.instance_group[0].kind == 2  # KIND_CPU
        for version in ("1", "2"):
            assert (tmp_path / model / version / "model.onnx").is_file()
            assert (
                (tmp_path / model / version / "model.py").read_text().startswith('"""Triton python-backend')
            )
    assert "wrote 15 files" in capsys.readouterr().out


def test_cli_refuses_zero_versions(tmp_path: Path) -> None:
    assert main(["models", "init", str(tmp_path), "--triton", "gpu", "--versions", "0"]) == 2
