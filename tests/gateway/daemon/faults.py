"""Faults injected into the CPU workers' tasks, in a module the workers import in milliseconds (they
already hold the pipelines): a test that imported the gateway to run there would spend its task timeout
on imports."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from edgewire import pb
from inference.backends.base import ModelSpec
from inference.pipeline.arena import Slot, payloads_in
from inference.pipeline.base import Prepared
from inference.pipeline.worker import prepare_batch


def prepare_or_stop(
    pipeline: str,
    spec: ModelSpec,
    payloads: Sequence[bytes],
    slot: Slot | None = None,
    lengths: Sequence[int] = (),
) -> Prepared:
    """``worker.prepare_batch``, except that a batch holding a request of tenant "hang" never finishes (a
    decoder spinning on it) and one holding a request of tenant "crash" kills its worker."""
    sources = payloads_in(slot, lengths) if slot is not None and lengths else payloads
    tenants = {pb.InferRequest.FromString(bytes(p)).tenant for p in sources}
    if "hang" in tenants:
        threading.Event().wait()
    if "crash" in tenants:
        os._exit(3)
    return prepare_batch(pipeline, spec, payloads, slot, lengths)
