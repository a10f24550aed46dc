"""Pipelines by the name in a model's ``pipeline`` parameter: ``ranking``, ``text``, ``image``, ``tensor``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import cache
from typing import Final

from gateway.backends.base import ModelSpec
from gateway.pipeline.base import Pipeline
from gateway.pipeline.image import ImagePipeline
from gateway.pipeline.ranking import RankingPipeline
from gateway.pipeline.tensor import InvalidInput, TensorPipeline
from gateway.pipeline.text import TextPipeline

_FACTORIES: Final[dict[str, Callable[[], Pipeline]]] = {
    "ranking": RankingPipeline,
    "text": TextPipeline,
    "image": ImagePipeline,
    "tensor": TensorPipeline,
}

PIPELINE_NAMES: Final = tuple(_FACTORIES)
PADDED_PIPELINES: Final = frozenset({"text"})
"""Pipelines that pad a batch to its longest request: the dispatcher batches them by size bucket."""
REJECT_LABELS: Final = tuple(label.value for label in InvalidInput)
"""Every label a pipeline drops a request with (for pre-registering metric series)."""


@cache
def pipeline_for(name: str) -> Pipeline:
    """The pipeline named by a model's spec (one shared instance per name); unknown names are a ValueError."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline {name!r}; known: {list(PIPELINE_NAMES)}") from None
    return factory()


def declared(spec: ModelSpec, pipeline: str | None, parameters: Mapping[str, str]) -> ModelSpec:
    """``spec`` with the gateway's pipeline declaration applied (``[pipelines.<model>]``)."""
    if pipeline is None and not parameters:
        return spec
    return dataclasses.replace(
        spec, pipeline=pipeline or spec.pipeline, parameters={**spec.parameters, **parameters}
    )
