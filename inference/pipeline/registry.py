"""Pipelines by the name in a model's ``pipeline`` parameter: ``ranking``, ``text``, ``image``, ``tensor``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import cache
from typing import Final, Protocol

from inference.backends.base import ModelSpec
from inference.pipeline.base import Pipeline
from inference.pipeline.image import ImagePipeline
from inference.pipeline.ranking import RankingPipeline
from inference.pipeline.tensor import InvalidInput, TensorPipeline
from inference.pipeline.text import TextPipeline


class PipelineOverride(Protocol):
    """What a gateway's ``[pipelines.<model>]`` declaration sets (gateway.config.ModelPipelineConfig)."""

    @property
    def pipeline(self) -> str | None: ...

    @property
    def parameters(self) -> Mapping[str, str]: ...


_FACTORIES: Final[dict[str, Callable[[], Pipeline]]] = {
    "ranking": RankingPipeline,
    "text": TextPipeline,
    "image": ImagePipeline,
    "tensor": TensorPipeline,
}

PIPELINE_NAMES: Final = tuple(_FACTORIES)
PADDED_PIPELINES: Final = frozenset({"text"})
"""Pipelines that pad a batch to its longest request: the dispatcher batches them by size bucket."""
CHEAP_PIPELINES: Final = frozenset({"ranking", "text", "tensor"})
"""Pipelines that cost tens of microseconds per request (image decoding costs milliseconds): their small
batches run on the gateway's event loop instead of paying for a thread or process hand-off."""
LOOP_PIPELINES: Final = frozenset({"tensor"})
"""Pipelines that only move bytes (wire tensors decoded and stacked: two copies): every batch of theirs runs
on the event loop. Shipping it to a worker would cost the loop as many copies (serializing the requests,
writing them to the arena) and the worker more (parsing, decoding, stacking, writing back)."""
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


class PipelineDeclarations:
    """The gateway's ``[pipelines.<model>]`` declarations, applied over the specs backends report.

    One instance serves every pool; a declared spec is built once per backend spec object (a backend swaps
    the object when it reloads the model) and kept in a bounded cache.
    """

    def __init__(self, declared: Mapping[str, PipelineOverride] | None = None) -> None:
        self._declared = dict(declared or {})
        self._specs: dict[int, tuple[ModelSpec, ModelSpec]] = {}  # id(backend's spec) -> (it, declared)

    def apply(self, spec: ModelSpec | None) -> ModelSpec | None:
        """``spec`` with its model's declaration applied; the spec itself when there is none."""
        override = None if spec is None else self._declared.get(spec.name)
        if spec is None or override is None:
            return spec
        cached = self._specs.get(id(spec))
        if cached is None or cached[0] is not spec:
            if len(self._specs) >= 1024:  # bounded: models x versions x backends
                self._specs.clear()
            parameters = {**spec.parameters, **override.parameters}
            cached = (
                spec,
                dataclasses.replace(spec, pipeline=override.pipeline or spec.pipeline, parameters=parameters),
            )
            self._specs[id(spec)] = cached
        return cached[1]
