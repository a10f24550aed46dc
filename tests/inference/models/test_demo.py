"""The demo model repository: deterministic bytes, loadable by ONNX Runtime, configs the gateway parses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from inference.backends.modelrepo import load_model_config
from inference.models import DEMO_MODELS, write_demo_repository, write_model_version


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_writes_give_identical_bytes(tmp_path: Path) -> None:
    """Writing the repository twice gives the same files, byte for byte."""
    write_demo_repository(tmp_path / "a")
    write_demo_repository(tmp_path / "b")
    first, second = tree(tmp_path / "a"), tree(tmp_path / "b")
    assert first == second
    assert sorted(first) == sorted(f"{m}/{f}" for m in DEMO_MODELS for f in ("config.pbtxt", "1/model.onnx"))


def test_returns_the_files_written(tmp_path: Path) -> None:
    """The returned paths are exactly the files on disk."""
    written = write_demo_repository(tmp_path)
    assert sorted(written) == sorted(p for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_model_loads_with_the_configured_io(tmp_path: Path, model: str) -> None:
    """Each model loads in ONNX Runtime with the input and output names its config declares."""
    write_demo_repository(tmp_path)
    config = load_model_config(tmp_path / model / "config.pbtxt")
    session = ort.InferenceSession(str(tmp_path / model / "1" / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == [i.name for i in config.input]
    assert [o.name for o in session.get_outputs()] == [o.name for o in config.output]


def test_another_seed_gives_other_outputs(tmp_path: Path) -> None:
    """Version 2 written with another seed scores the same input differently."""
    write_demo_repository(tmp_path)
    write_model_version(tmp_path, "rank-mlp", 2, seed=7)
    features = np.random.default_rng(0).standard_normal((4, 40)).astype(np.float32)
    sessions = [ort.InferenceSession(str(tmp_path / "rank-mlp" / v / "model.onnx")) for v in ("1", "2")]
    rows = np.arange(4, dtype=np.int64).reshape(4, 1)
    scores = [session.run(None, {"features": features, "item_rows": rows})[0] for session in sessions]
    assert scores[0].shape == scores[1].shape == (4, 1)
    assert not np.allclose(scores[0], scores[1])


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    """Asking for a model the demo does not have is a ValueError naming the known ones."""
    with pytest.raises(ValueError, match="rank-mlp"):
        write_model_version(tmp_path, "resnet-50", 1, seed=1)
