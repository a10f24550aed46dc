"""The ``triton`` backend: NVIDIA Triton Inference Server over gRPC (KServe v2), through tritonclient.

Per call: the model and its pinned version, Triton's ``priority`` from the request's priority class, and
``timeout`` from its remaining deadline, which Triton enforces in its queue when the model's
``default_queue_policy`` allows a timeout override (``deploy/triton`` shows the config). Triton's
"Request timeout expired" is DEADLINE_EXCEEDED; a full queue ("Exceeds maximum queue size") and
RESOURCE_EXHAUSTED are OVERLOADED, shed and retried elsewhere; other UNAVAILABLE answers count against
the backend's circuit breaker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gateway.backends.kserve.backend import KServeBackend
from gateway.backends.kserve.dialect import ServerAnswer, common_error
from gateway.backends.kserve.options import KServeOptions
from inference.backends.base import Backend, BackendError, InferCall, register
from inference.backends.options import backend_options
from routing.types import Priority

QUEUE_FULL: Final = "Exceeds maximum queue size"
QUEUE_TIMEOUT: Final = "Request timeout expired"
# Triton's priority 1 is the highest; realtime takes it, batch takes the lowest level the model has.
_RANK: Final = {Priority.REALTIME: 1, Priority.INTERACTIVE: 2, Priority.BATCH: 3}


class TritonDialect:
    """Triton's priorities and error answers."""

    kind = "triton"

    def headers(self) -> Mapping[str, str]:
        return {}

    def priority(self, priority: Priority, levels: int) -> int:
        """1 (highest) for realtime .. ``levels`` for batch; 0 (the model's default) without levels."""
        if levels <= 0:
            return 0
        if priority is Priority.BATCH:
            return levels
        return min(_RANK[priority], levels)

    def error(self, answer: ServerAnswer, call: InferCall) -> BackendError:
        where = f"triton model {call.model}"
        if answer.code == "UNAVAILABLE" and QUEUE_TIMEOUT in answer.message:
            return BackendError(
                f"{where}: deadline passed in Triton's queue", retryable=False, status="DEADLINE_EXCEEDED"
            )
        if answer.code == "UNAVAILABLE" and QUEUE_FULL in answer.message:
            return BackendError(
                f"{where}: Triton's queue is full", retryable=True, overloaded=True, status="OVERLOADED"
            )
        return common_error(answer, call, where)


@backend_options("triton")
class TritonOptions(KServeOptions):
    """The ``triton`` backend's options: those of every KServe v2 backend."""


@register("triton")
def create_triton_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Factory for ``type = "triton"``: a KServe v2 gRPC backend with Triton's dialect."""
    return KServeBackend(name, TritonOptions.from_mapping(name, options), TritonDialect())
