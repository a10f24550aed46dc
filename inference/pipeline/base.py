"""The CPU stage between routing and the backend call: wire requests -> dense tensors -> wire outputs.

One pipeline per request kind, chosen by the model's ``pipeline`` parameter. A pipeline works on a whole
batch with vectorised calls; a request it cannot use (a corrupt image, a wrong feature width) is dropped from
the batch with a reason, never allowed to fail the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from edgewire import pb
from edgewire.scan import Buffer
from inference.backends.base import ModelSpec
from inference.pipeline.arena import Placed, Slot


@dataclass(slots=True)
class Prepared:
    """A batch ready for a backend.

    ``inputs`` hold the batch dim first. ``rows[i]`` is the slice of output rows that belongs to
    ``kept[i]``, the index of a request in the original batch. ``rejected`` maps the index of each request
    that was dropped to the reason (an InvalidInput label and a human-readable detail).
    """

    inputs: dict[str, np.ndarray]
    kept: list[int]
    rows: list[slice]
    rejected: dict[int, tuple[str, str]] = field(default_factory=dict)
    real_elements: int = 0  # tokens / pixels / feature cells before padding
    padded_elements: int = 0  # the same after padding (padding waste = 1 - real / padded)
    truncated: int = 0  # kept requests cut to the model's limit (served, and counted by the gateway)
    spec: ModelSpec | None = None  # the model it was prepared for (finish may run in another process)
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # what finish needs besides the outputs
    placed: Placed = field(default_factory=dict)  # inputs a worker wrote into the arena instead
    slot: Slot | None = None  # the arena slot they are in, until the gateway gives it back
    where: str | None = None  # where the gateway's CPU stage prepared it ("loop", "thread", "": a worker)


class Pipeline(Protocol):
    """Pre- and post-processing for one request kind."""

    kind: str

    def prepare(self, requests: Sequence[pb.InferRequest], spec: ModelSpec) -> Prepared:
        """Turn a batch of requests into the model's input tensors (one vectorised pass)."""
        ...

    def finish(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[list[pb.Tensor]]:
        """Per kept request (in ``prepared.kept`` order), the wire output tensors.

        Everything besides the outputs comes from ``prepared`` (``spec``, ``extras``): finish runs where the
        requests are not sent a second time.
        """
        ...


class ResponsePipeline(Protocol):
    """A pipeline that also writes its answers as bytes, without building ``pb.Tensor`` objects: the
    serialized outputs are most of what ``finish`` costs for small requests."""

    def finish_bytes(self, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
        """Per kept request, ``InferResponse(outputs=tensors).SerializeToString()`` of the tensors
        :meth:`Pipeline.finish` gives it, byte for byte."""
        ...


@runtime_checkable
class PayloadPipeline(Protocol):
    """A pipeline that can also read its requests' bytes (the frame they came in) instead of the parsed
    requests' fields, which upb copies out on every access (``TensorPipeline``: a tensor's raw_data)."""

    def prepare_views(
        self, requests: Sequence[pb.InferRequest], payloads: Sequence[Buffer], spec: ModelSpec
    ) -> Prepared:
        """:meth:`Pipeline.prepare`, with ``payloads[i]`` the encoding of ``requests[i]``."""
        ...
