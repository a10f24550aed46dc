"""The demo models as a Triton Inference Server model repository: ``config.pbtxt`` for GPU or CPU instances.

The configs are the production shape: Triton's dynamic batcher with preferred sizes and a queue delay,
three priority levels (realtime 1, interactive 2, batch 3), a bounded queue that REJECTs on overflow and on
a request's own timeout, KIND_GPU instances (or KIND_CPU for CPU servers) and a version policy that keeps
the two latest versions loaded for a roll-back. ``deploy/triton/{gpu,cpu}`` hold the same files, checked by
a test. ``runtime = "python"`` serves the same ``model.onnx`` through a python-backend shim
(``triton_python_model.py``) for Triton builds without the onnxruntime backend.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Final, Literal

from google.protobuf import text_format

from edgewire.pb.triton import model_config_pb2
from inference.models.demo import (
    CONFIG_FILENAME,
    DEFAULT_SEED,
    DEMO_MODELS,
    IMAGE_MODEL,
    RANKING_MODEL,
    TEXT_MODEL,
    demo_config,
    write_model_version,
)

InstanceKind = Literal["gpu", "cpu"]
Runtime = Literal["onnxruntime", "python"]
INSTANCE_KINDS: Final = ("gpu", "cpu")
RUNTIMES: Final = ("onnxruntime", "python")
PRIORITY_LEVELS: Final = 3
PYTHON_MODEL_SOURCE: Final = Path(__file__).with_name("triton_python_model.py")

# Per model: preferred batch sizes (rows for ranking, requests otherwise), the queue delay, queue bound.
_BATCHING: Final[dict[str, tuple[tuple[int, ...], int, int]]] = {
    RANKING_MODEL: ((1024, 4096), 2000, 512),
    TEXT_MODEL: ((16, 32, 64), 2000, 512),
    IMAGE_MODEL: ((8, 16, 32), 3000, 256),
}
DEFAULT_TIMEOUT_US: Final = 10_000_000  # a request without its own timeout waits at most 10 s in the queue


def triton_config(
    model: str,
    *,
    kind: InstanceKind = "gpu",
    runtime: Runtime = "onnxruntime",
    instances: int | None = None,
    max_queue_size: int | None = None,
    test_execute_delay_s: float = 0.0,
) -> Any:
    """Triton's ModelConfig for a demo model (``model_config_pb2.ModelConfig``)."""
    if kind not in INSTANCE_KINDS:
        raise ValueError(f"instance kind must be one of {INSTANCE_KINDS}, got {kind!r}")
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    mc = model_config_pb2
    config = demo_config(model)
    config.backend = runtime
    config.version_policy.latest.num_versions = 2
    preferred, delay_us, queue = _BATCHING[model]
    batching = config.dynamic_batching
    batching.preferred_batch_size.extend(p for p in preferred if p <= config.max_batch_size)
    batching.max_queue_delay_microseconds = delay_us
    batching.priority_levels = PRIORITY_LEVELS
    batching.default_priority_level = 2
    # REJECT: a request still queued when its timeout passes is answered "Request timeout expired" at
    # once; allow_timeout_override lets each request bring its own (shorter) deadline.
    batching.default_queue_policy.timeout_action = mc.ModelQueuePolicy.REJECT
    batching.default_queue_policy.default_timeout_microseconds = DEFAULT_TIMEOUT_US
    batching.default_queue_policy.allow_timeout_override = True
    batching.default_queue_policy.max_queue_size = queue if max_queue_size is None else max_queue_size
    group = config.instance_group.add()
    # Two instances per GPU overlap one batch's copies with another's compute; one per CPU model.
    group.count = instances if instances is not None else (2 if kind == "gpu" else 1)
    group.kind = mc.ModelInstanceGroup.KIND_GPU if kind == "gpu" else mc.ModelInstanceGroup.KIND_CPU
    if test_execute_delay_s:
        config.parameters["test_execute_delay_s"].string_value = repr(test_execute_delay_s)
    return config


def config_text(config: Any) -> str:
    """``config.pbtxt`` text of a ModelConfig, as Triton reads it."""
    text: str = text_format.MessageToString(config)
    return text


def write_triton_repository(
    root: Path,
    *,
    kind: InstanceKind = "gpu",
    runtime: Runtime = "onnxruntime",
    instances: int | None = None,
    versions: int = 1,
    models: tuple[str, ...] = DEMO_MODELS,
    max_queue_size: int | None = None,
    test_execute_delay_s: float = 0.0,
) -> list[Path]:
    """Write the demo models in Triton's layout under ``root``; returns the files written."""
    written: list[Path] = []
    for model in models:
        directory = root / model
        directory.mkdir(parents=True, exist_ok=True)
        config = triton_config(
            model,
            kind=kind,
            runtime=runtime,
            instances=instances,
            max_queue_size=max_queue_size,
            test_execute_delay_s=test_execute_delay_s,
        )
        config_path = directory / CONFIG_FILENAME
        config_path.write_text(config_text(config), encoding="utf-8")
        written.append(config_path)
        for version in range(1, versions + 1):
            written.extend(
                p
                for p in write_model_version(root, model, version, DEFAULT_SEED + version - 1)
                if p != config_path
            )
            if runtime == "python":
                target = directory / str(version) / "model.py"
                shutil.copyfile(PYTHON_MODEL_SOURCE, target)
                written.append(target)
    return written
