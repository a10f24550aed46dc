"""Models the gateway ships for its demo, tests and benchmarks, written as a Triton model repository."""

from gateway.models.demo import (
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
