"""The CPU stage's entry points, run in worker processes (bytes in, arrays and bytes out) or, for work
cheaper than the hand-off, in the gateway itself (``prepare_requests``: the parsed requests in).

Requests travel as serialized protobuf (cheap to pickle), prepared batches as numpy arrays, and results
come back as serialized ``InferResponse`` fragments holding only the outputs; the gateway's event loop
appends its own fields by concatenation (protobuf merges concatenated messages) and never re-parses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from edgewire import pb
from edgewire.scan import Buffer
from inference.backends.base import ModelSpec
from inference.pipeline.arena import Slot, payloads_in, place
from inference.pipeline.base import PayloadPipeline, Prepared, ResponsePipeline
from inference.pipeline.registry import pipeline_for


def prepare_batch(
    pipeline: str,
    spec: ModelSpec,
    payloads: Sequence[bytes],
    slot: Slot | None = None,
    lengths: Sequence[int] = (),
) -> Prepared:
    """Parse the requests and build the model's input tensors in one vectorised pass.

    With a ``slot`` of the gateway's arena the tensors are written there and only their places travel
    back (tensors that do not fit travel back whole); with ``lengths`` the requests are read from the
    start of the slot instead of ``payloads``.
    """
    sources: Sequence[bytes | memoryview] = (
        payloads_in(slot, lengths) if slot is not None and lengths else payloads
    )
    # upb parses any buffer without a copy (the arena's views included); the stubs only admit bytes.
    requests = [pb.InferRequest.FromString(cast(bytes, p)) for p in sources]
    prepared = prepare_requests(pipeline, spec, requests, sources)
    if slot is not None and prepared.inputs:
        placed = place(slot, prepared.inputs, start=sum(lengths))
        if placed is not None:
            prepared.inputs = {}
            prepared.placed = placed
    return prepared


def prepare_requests(
    pipeline: str,
    spec: ModelSpec,
    requests: Sequence[pb.InferRequest],
    payloads: Sequence[Buffer] | None = None,
) -> Prepared:
    """The batch's input tensors from requests already parsed (the gateway's own, on its event loop or a
    local thread: nothing to serialize and parse again).

    ``payloads``: the requests' own bytes (views of the frame they came in, or of an arena slot), for the
    pipelines that read tensors there in place (:class:`~inference.pipeline.base.PayloadPipeline`).
    """
    chosen = pipeline_for(pipeline)
    # Not isinstance(chosen, PayloadPipeline): a runtime Protocol check walks the protocol's attributes on
    # every call (~18 us per batch, for a lone realtime request a tenth of its cost).
    if payloads is not None and hasattr(chosen, "prepare_views"):
        prepared = cast(PayloadPipeline, chosen).prepare_views(requests, payloads, spec)
    else:
        prepared = chosen.prepare(requests, spec)
    prepared.spec = spec
    return prepared


def finish_batch(pipeline: str, prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> list[bytes]:
    """Per kept request, its outputs as response bytes; what the pipeline needs besides the outputs is in
    ``prepared`` (the requests are not sent again)."""
    chosen = pipeline_for(pipeline)
    if hasattr(chosen, "finish_bytes"):  # not isinstance: see prepare_requests
        return cast(ResponsePipeline, chosen).finish_bytes(prepared, outputs)
    tensors = chosen.finish(prepared, outputs)
    return [pb.InferResponse(outputs=t).SerializeToString() for t in tensors]


def without_inputs(prepared: Prepared) -> Prepared:
    """The prepared batch minus its input tensors: what finish needs, without shipping arrays twice."""
    return dataclasses.replace(prepared, inputs={}, placed={}, slot=None)


def die_with_parent(sig: int = 9) -> None:
    """Worker initializer: a gateway killed with SIGKILL must not leave its CPU workers behind (Linux).
    ``sig`` is what this process gets when its parent dies (a shard asks for SIGTERM, to drain)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)


def ping() -> int:
    """Proves a worker is up (and imported the pipelines)."""
    import os

    return os.getpid()
