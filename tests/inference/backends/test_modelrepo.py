"""The model repository: configs become ModelSpecs, versions are chosen and rescanned, bad configs named."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.backends.base import ModelSpec, TensorSpec
from inference.backends.modelrepo import (
    ModelRepository,
    ModelRepositoryError,
    RepositoryOptions,
    config_from_spec,
    spec_from_config,
)
from inference.models import DEMO_MODELS, demo_config, write_demo_repository, write_model_version
from inference.models.demo import RANKING_NORMALISATION

TESTDATA = Path(__file__).parent / "testdata"
BAD_CONFIGS = sorted(TESTDATA.glob("*.pbtxt"))
MINIMAL_CONFIG = """
max_batch_size: 8
input { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }
output { name: "y" data_type: TYPE_FP32 dims: [ 1 ] }
"""


def add_model(root: Path, name: str, config: str, versions: tuple[str, ...] = ("1",)) -> Path:
    """A model directory with ``config`` and a placeholder model file in each version directory."""
    (root / name).mkdir(parents=True)
    for version in versions:
        (root / name / version).mkdir()
        (root / name / version / "model.onnx").write_bytes(b"placeholder")
    (root / name / "config.pbtxt").write_text(config)
    return root / name / "config.pbtxt"


def test_ranking_config_maps_to_spec(tmp_path: Path) -> None:
    """rank-mlp's config.pbtxt becomes the ModelSpec the ranking pipeline reads."""
    write_demo_repository(tmp_path)
    repo = ModelRepository(tmp_path)
    repo.scan()
    assert repo.spec("rank-mlp") == ModelSpec(
        name="rank-mlp",
        version="1",
        inputs=(TensorSpec("features", "float32", (40,)), TensorSpec("item_rows", "int64", (1,))),
        outputs=(TensorSpec("scores", "float32", (1,)),),
        max_batch_size=8192,
        pipeline="ranking",
        server_batching=False,
        parameters={
            "candidate_feature_width": "8",
            "pipeline": "ranking",
            "tag_buckets": "16",
            "user_feature_width": "16",
            "item_table_rows": "4096",
            **RANKING_NORMALISATION,
        },
    )


def test_text_config_keeps_variable_dims(tmp_path: Path) -> None:
    """Variable sequence dims stay -1 and INT64 maps to the numpy name int64."""
    write_demo_repository(tmp_path)
    repo = ModelRepository(tmp_path)
    repo.scan()
    spec = repo.spec("text-encoder")
    assert spec is not None
    assert spec.inputs == (
        TensorSpec("input_ids", "int64", (-1,)),
        TensorSpec("attention_mask", "int64", (-1,)),
    )
    assert (spec.pipeline, spec.max_batch_size) == ("text", 64)


def test_latest_version_is_the_default(tmp_path: Path) -> None:
    """With versions 1, 2 and 10 on disk, an empty version means 10."""
    add_model(tmp_path, "m", MINIMAL_CONFIG, ("1", "2", "10"))
    entry = ModelRepository(tmp_path).scan()["m"]
    assert (entry.available, entry.loaded, entry.default) == ((1, 2, 10), (10,), 10)


def test_pinned_version_is_the_default(tmp_path: Path) -> None:
    """A pin makes an older version the default and loads it beside the latest."""
    add_model(tmp_path, "m", MINIMAL_CONFIG, ("1", "2"))
    repo = ModelRepository(tmp_path, pins={"m": "1"})
    entry = repo.scan()["m"]
    assert (entry.loaded, entry.default) == ((1, 2), 1)
    spec = repo.spec("m")
    assert spec is not None
    assert spec.version == "1"


def test_pin_to_a_missing_version_is_refused(tmp_path: Path) -> None:
    """Pinning a version that is not on disk names the config and the version field."""
    add_model(tmp_path, "m", MINIMAL_CONFIG)
    with pytest.raises(ModelRepositoryError, match="pinned version 5") as caught:
        ModelRepository(tmp_path, pins={"m": 5}).scan()
    assert caught.value.field == "version"


def test_non_numeric_directories_are_ignored(tmp_path: Path) -> None:
    """Directories like ``latest`` or ``1a`` beside the versions are not versions."""
    add_model(tmp_path, "m", MINIMAL_CONFIG, ("1", "latest", "1a"))
    assert ModelRepository(tmp_path).scan()["m"].available == (1,)


def test_version_without_model_file_is_not_served(tmp_path: Path) -> None:
    """A version directory still being written (no model file yet) is skipped."""
    add_model(tmp_path, "m", MINIMAL_CONFIG)
    (tmp_path / "m" / "2").mkdir()
    assert ModelRepository(tmp_path).scan()["m"].default == 1


def test_model_without_versions_is_not_served(tmp_path: Path) -> None:
    """A model directory with only its config is absent from the scan."""
    add_model(tmp_path, "m", MINIMAL_CONFIG, ())
    assert ModelRepository(tmp_path).scan() == {}


def test_rescan_reports_new_version(tmp_path: Path) -> None:
    """A version directory added after the first scan is reported added, the old one removed."""
    write_demo_repository(tmp_path)
    repo = ModelRepository(tmp_path)
    repo.scan()
    write_model_version(tmp_path, "text-encoder", 2, seed=2)
    change = repo.rescan()
    assert change.added == (("text-encoder", "2"),)
    assert change.removed == (("text-encoder", "1"),)
    assert not repo.rescan()


def test_too_many_models_are_refused(tmp_path: Path) -> None:
    """More model directories than max_models is an error naming the repository."""
    for name in ("a", "b", "c"):
        add_model(tmp_path, name, MINIMAL_CONFIG)
    with pytest.raises(ModelRepositoryError, match="more than the limit of 2") as caught:
        ModelRepository(tmp_path, max_models=2).scan()
    assert caught.value.path == tmp_path


def test_dynamic_batching_means_server_batching(tmp_path: Path) -> None:
    """A dynamic_batching block turns gateway-side batching off for the model."""
    add_model(tmp_path, "m", MINIMAL_CONFIG + "dynamic_batching { max_queue_delay_microseconds: 100 }")
    repo = ModelRepository(tmp_path)
    repo.scan()
    spec = repo.spec("m")
    assert spec is not None
    assert spec.server_batching


def test_model_without_pipeline_parameter_uses_tensor(tmp_path: Path) -> None:
    """A plain Triton config (no pipeline parameter) is served by the generic tensor pipeline."""
    add_model(tmp_path, "m", MINIMAL_CONFIG)
    repo = ModelRepository(tmp_path)
    repo.scan()
    spec = repo.spec("m")
    assert spec is not None
    assert spec.pipeline == "tensor"


def test_all_versions_policy_loads_every_version(tmp_path: Path) -> None:
    """``version_policy { all {} }`` loads every version; the latest is the default."""
    add_model(tmp_path, "m", MINIMAL_CONFIG + "version_policy { all {} }", ("1", "2", "3"))
    entry = ModelRepository(tmp_path).scan()["m"]
    assert (entry.loaded, entry.default) == ((1, 2, 3), 3)


def test_missing_config_is_named(tmp_path: Path) -> None:
    """A model directory without config.pbtxt is an error naming that file."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    with pytest.raises(ModelRepositoryError, match=r"config\.pbtxt: config: missing"):
        ModelRepository(tmp_path).scan()


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=[p.stem for p in BAD_CONFIGS])
def test_bad_config_names_file_and_field(tmp_path: Path, path: Path) -> None:
    """Each bad config in testdata/ is refused with an error naming the file and the field."""
    text = path.read_text()
    expected = text.splitlines()[0].removeprefix("# expect: ").strip()
    config = add_model(tmp_path, "m", text)
    with pytest.raises(ModelRepositoryError) as caught:
        ModelRepository(tmp_path).scan()
    assert (caught.value.path, caught.value.field) == (config, expected)
    assert str(caught.value).startswith(f"{config}: {expected}: ")


def test_options_need_a_repository_when_required() -> None:
    """A backend that needs a repository says which option is missing."""
    with pytest.raises(ValueError, match="'repository' is required"):
        RepositoryOptions.from_mapping("cpu", {}, required=True)


def test_options_refuse_a_bad_pin() -> None:
    """Pins must map names to versions."""
    with pytest.raises(ValueError, match="'pins'"):
        RepositoryOptions.from_mapping("cpu", {"repository": "/x", "pins": ["rank-mlp"]}, required=True)


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_config_from_spec_reads_back_as_the_same_spec(model: str) -> None:
    """config_from_spec is spec_from_config's inverse (what deploy/rayserve answers for ModelConfig)."""
    spec = spec_from_config(demo_config(model), "1", Path("x"))
    assert spec_from_config(config_from_spec(spec, backend="rayserve"), "1", Path("x")) == spec
