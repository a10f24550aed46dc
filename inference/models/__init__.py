"""Demo models both programs use (tests, benchmarks, the edge tier, the gateway), as a Triton repository."""

from inference.models.demo import (
    DEMO_MODELS,
    IMAGE_LABELS,
    IMAGE_MODEL,
    RANKING_MODEL,
    TEXT_MODEL,
    demo_config,
    write_demo_repository,
    write_model_version,
)

__all__ = [
    "DEMO_MODELS",
    "IMAGE_LABELS",
    "IMAGE_MODEL",
    "RANKING_MODEL",
    "TEXT_MODEL",
    "demo_config",
    "write_demo_repository",
    "write_model_version",
]
