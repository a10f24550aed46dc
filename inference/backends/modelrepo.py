"""A Triton-layout model repository on disk: ``<root>/<model>/config.pbtxt`` + ``<root>/<model>/<version>/``.

:class:`ModelRepository` scans the directory, parses each ``config.pbtxt`` (Triton's ModelConfig text
format) into a :class:`~inference.backends.base.ModelSpec`, lists the numeric version directories that hold a
model file, and picks the versions to load (the config's ``version_policy``, plus a pinned version) and the
serving default (the pin, else the latest). :meth:`ModelRepository.rescan` notices new or removed version
directories without a restart and says what changed.

The gateway pipeline of a model comes from its ``pipeline`` parameter
(``parameters { key: "pipeline" value { string_value: "ranking" } }``); a model without one is served by the
generic ``tensor`` pipeline. Every refusal is a :class:`ModelRepositoryError` naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Self, TypeAlias

from google.protobuf import text_format
from pydantic import Field

from edgewire.pb.triton import model_config_pb2
from inference.backends.base import ModelSpec, TensorSpec
from inference.backends.options import BackendOptions, BackendOptionsError, integer, version

# Triton's schema, vendored (proto/triton): the agent's local tier reads repositories without tritonclient.
ModelConfig: TypeAlias = model_config_pb2.ModelConfig

CONFIG_FILENAME: Final = "config.pbtxt"
DEFAULT_MODEL_FILENAME: Final = "model.onnx"
PIPELINES: Final = frozenset({"ranking", "text", "image", "tensor"})
DEFAULT_PIPELINE: Final = "tensor"
MAX_CONFIG_BYTES: Final = 1 << 20
DEFAULT_MAX_MODELS: Final = 64

# Triton data types -> numpy dtype names. BF16 has no numpy dtype and is refused by name.
NUMPY_DTYPES: Final[Mapping[str, str]] = {
    "TYPE_BOOL": "bool",
    "TYPE_UINT8": "uint8",
    "TYPE_UINT16": "uint16",
    "TYPE_UINT32": "uint32",
    "TYPE_UINT64": "uint64",
    "TYPE_INT8": "int8",
    "TYPE_INT16": "int16",
    "TYPE_INT32": "int32",
    "TYPE_INT64": "int64",
    "TYPE_FP16": "float16",
    "TYPE_FP32": "float32",
    "TYPE_FP64": "float64",
    "TYPE_STRING": "object",
}


_TRITON_TYPES: Final = {numpy: triton for triton, numpy in NUMPY_DTYPES.items()}


class ModelRepositoryError(ValueError):
    """A repository, model directory or ``config.pbtxt`` the gateway cannot serve; names file and field."""

    def __init__(self, path: Path, field: str, message: str) -> None:
        super().__init__(f"{path}: {field}: {message}")
        self.path = path
        self.field = field


class RepositoryOptions(BackendOptions):
    """The repository part of a backend's options: ``repository``, ``pins`` and ``max_models``."""

    repository: Path | None = None  # the model repository directory
    pins: dict[str, Annotated[str, version()]] = Field(default_factory=dict)  # model -> default version
    max_models: Annotated[int, integer()] = DEFAULT_MAX_MODELS

    @classmethod
    def from_mapping(cls, backend: str, options: Mapping[str, Any], *, required: bool = False) -> Self:
        """Validate the keys; ``required``: a missing ``repository`` is refused too."""
        read = super().from_mapping(backend, options)
        if required and read.repository is None:
            raise BackendOptionsError(backend, [("repository", "is required")])
        return read


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model of a scan: its config, the versions on disk, the versions to load and the default."""

    name: str
    directory: Path
    config: ModelConfig
    available: tuple[int, ...]  # numeric version directories holding the model file, ascending
    loaded: tuple[int, ...]  # the versions to serve: the version policy's choice plus any pin
    default: int  # what an empty version means: the pin, else the latest loaded

    def spec(self, version: int) -> ModelSpec:
        """The spec of one version of this model."""
        return spec_from_config(self.config, str(version), self.directory / CONFIG_FILENAME)

    def model_path(self, version: int) -> Path:
        """The model file of one version."""
        return self.directory / str(version) / model_filename(self.config)


@dataclass(frozen=True, slots=True)
class RepositoryChange:
    """What a rescan found: (model, version) pairs that appeared and that went away (versions as strings)."""

    added: tuple[tuple[str, str], ...]
    removed: tuple[tuple[str, str], ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


class ModelRepository:
    """A model repository directory and its latest scan.

    ``pins`` maps a model name to the version it serves by default (a string or int, as config passes it);
    a pinned version must exist. More than ``max_models`` model directories is refused, so a wrong path
    (a home directory, say) fails clearly instead of parsing thousands of files.
    """

    def __init__(
        self, root: Path, *, pins: Mapping[str, str | int] | None = None, max_models: int = DEFAULT_MAX_MODELS
    ) -> None:
        if max_models < 1:
            raise ValueError(f"max_models must be at least 1, got {max_models}")
        self.root = root
        self.max_models = max_models
        self._pins = {model: _pin_version(root, model, v) for model, v in (pins or {}).items()}
        self._models: dict[str, ModelEntry] = {}

    @property
    def models(self) -> Mapping[str, ModelEntry]:
        """The models of the last scan that have at least one version, by name."""
        return self._models

    def scan(self) -> Mapping[str, ModelEntry]:
        """Read the repository afresh; on :class:`ModelRepositoryError` the previous scan stays."""
        self._models = scan_repository(self.root, pins=self._pins, max_models=self.max_models)
        return self._models

    def rescan(self) -> RepositoryChange:
        """Scan again and report which (model, version) pairs to load or drop."""
        before = self._loaded_pairs()
        self.scan()
        after = self._loaded_pairs()
        return RepositoryChange(added=tuple(sorted(after - before)), removed=tuple(sorted(before - after)))

    def spec(self, name: str, version: str = "") -> ModelSpec | None:
        """The spec of a loaded model version ("" = the default), or None."""
        entry = self._models.get(name)
        if entry is None:
            return None
        chosen = entry.default if version == "" else _as_version(version)
        if chosen is None or chosen not in entry.loaded:
            return None
        return entry.spec(chosen)

    def _loaded_pairs(self) -> set[tuple[str, str]]:
        return {(name, str(v)) for name, entry in self._models.items() for v in entry.loaded}


def scan_repository(
    root: Path, *, pins: Mapping[str, int] | None = None, max_models: int = DEFAULT_MAX_MODELS
) -> dict[str, ModelEntry]:
    """Scan ``root`` once: every model directory with at least one version, by name."""
    if not root.is_dir():
        raise ModelRepositoryError(root, "repository", "not a directory")
    model_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(model_dirs) > max_models:
        raise ModelRepositoryError(
            root, "repository", f"{len(model_dirs)} model directories, more than the limit of {max_models}"
        )
    pins = pins or {}
    models: dict[str, ModelEntry] = {}
    for directory in model_dirs:
        config_path = directory / CONFIG_FILENAME
        config = load_model_config(config_path)
        spec_from_config(config, "", config_path)  # refuse a bad config now, not on first use
        filename = model_filename(config)
        available = tuple(
            sorted(
                int(p.name)
                for p in directory.iterdir()
                if p.name.isdecimal() and p.is_dir() and (p / filename).is_file()
            )
        )
        pin = pins.get(directory.name)
        if pin is not None and pin not in available:
            raise ModelRepositoryError(
                config_path, "version", f"pinned version {pin} not found; versions on disk: {list(available)}"
            )
        if not available:
            continue
        loaded = _policy_versions(config, available, config_path)
        if pin is not None and pin not in loaded:
            loaded = tuple(sorted((*loaded, pin)))
        default = pin if pin is not None else max(loaded)
        models[directory.name] = ModelEntry(directory.name, directory, config, available, loaded, default)
    return models


def load_model_config(path: Path) -> ModelConfig:
    """Parse one ``config.pbtxt`` into Triton's ModelConfig; the model name defaults to the directory's."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelRepositoryError(path, "config", "missing") from None
    if size > MAX_CONFIG_BYTES:
        raise ModelRepositoryError(path, "config", f"{size} bytes, more than the limit of {MAX_CONFIG_BYTES}")
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), config)
    except text_format.ParseError as exc:
        raise ModelRepositoryError(path, "config", f"not a Triton ModelConfig: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ModelRepositoryError(path, "config", f"not UTF-8 text: {exc}") from None
    if not config.name:
        config.name = path.parent.name
    elif config.name != path.parent.name:
        raise ModelRepositoryError(
            path, "name", f"{config.name!r} differs from the model directory {path.parent.name!r}"
        )
    return config


def spec_from_config(config: ModelConfig, version: str, path: Path) -> ModelSpec:
    """Map a ModelConfig to the gateway's ModelSpec; ``path`` names the file in errors."""
    if config.max_batch_size < 0:
        raise ModelRepositoryError(
            path, "max_batch_size", f"must not be negative, got {config.max_batch_size}"
        )
    if not config.input:
        raise ModelRepositoryError(path, "input", "a model needs at least one input")
    if not config.output:
        raise ModelRepositoryError(path, "output", "a model needs at least one output")
    parameters = {key: param.string_value for key, param in sorted(config.parameters.items())}
    pipeline = parameters.get("pipeline", DEFAULT_PIPELINE)
    if pipeline not in PIPELINES:
        raise ModelRepositoryError(
            path, "parameters.pipeline", f"unknown pipeline {pipeline!r}; known: {sorted(PIPELINES)}"
        )
    return ModelSpec(
        name=config.name,
        version=version,
        inputs=tuple(_tensor_spec(t, f"input[{i}]", path) for i, t in enumerate(config.input)),
        outputs=tuple(_tensor_spec(t, f"output[{i}]", path) for i, t in enumerate(config.output)),
        max_batch_size=int(config.max_batch_size),
        pipeline=pipeline,
        server_batching=config.HasField("dynamic_batching"),
        parameters=parameters,
    )


def config_from_spec(spec: ModelSpec, *, backend: str) -> ModelConfig:
    """A ModelConfig that :func:`spec_from_config` reads back as ``spec`` (for servers and tools that
    describe models they hold as specs, e.g. deploy/rayserve's ModelConfig answers)."""
    config = model_config_pb2.ModelConfig(name=spec.name, max_batch_size=spec.max_batch_size, backend=backend)
    for tensors, target in ((spec.inputs, config.input), (spec.outputs, config.output)):
        for tensor in tensors:
            data_type = model_config_pb2.DataType.Value(_TRITON_TYPES[tensor.dtype])
            target.add(name=tensor.name, data_type=data_type, dims=list(tensor.dims))
    for key, value in sorted({**spec.parameters, "pipeline": spec.pipeline}.items()):
        config.parameters[key].string_value = value
    if spec.server_batching:
        config.dynamic_batching.SetInParent()
    return config


def model_filename(config: ModelConfig) -> str:
    """The file inside a version directory: the config's ``default_model_filename`` or ``model.onnx``."""
    name: str = config.default_model_filename or DEFAULT_MODEL_FILENAME
    return name


def _tensor_spec(tensor: Any, where: str, path: Path) -> TensorSpec:
    if not tensor.name:
        raise ModelRepositoryError(path, f"{where}.name", "missing")
    type_name = model_config_pb2.DataType.Name(tensor.data_type)
    try:
        dtype = NUMPY_DTYPES[type_name]
    except KeyError:
        raise ModelRepositoryError(
            path, f"{where}.data_type", f"{type_name} is not supported; supported: {sorted(NUMPY_DTYPES)}"
        ) from None
    dims = tuple(int(d) for d in tensor.dims)
    if any(d < -1 or d == 0 for d in dims):
        raise ModelRepositoryError(path, f"{where}.dims", f"dims must be positive or -1, got {list(dims)}")
    return TensorSpec(name=tensor.name, dtype=dtype, dims=dims)


def _policy_versions(config: ModelConfig, available: tuple[int, ...], path: Path) -> tuple[int, ...]:
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return available
    if which == "specific":
        wanted = set(policy.specific.versions)
        chosen = tuple(v for v in available if v in wanted)
        if not chosen:
            raise ModelRepositoryError(
                path, "version_policy.specific", f"none of {sorted(wanted)} on disk: {list(available)}"
            )
        return chosen
    count = policy.latest.num_versions if which == "latest" else 1
    if count < 1:
        raise ModelRepositoryError(path, "version_policy.latest.num_versions", f"must be >= 1, got {count}")
    return available[-count:]


def _pin_version(root: Path, model: str, version: str | int) -> int:
    pinned = _as_version(str(version))
    if pinned is None:
        raise ModelRepositoryError(
            root, f"pins.{model}", f"version must be a positive integer, got {version!r}"
        )
    return pinned


def _as_version(text: str) -> int | None:
    return int(text) if text.isdecimal() and int(text) > 0 else None
