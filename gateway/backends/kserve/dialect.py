"""What differs between servers that speak KServe v2 (a :class:`Dialect`), and the answers they share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from edgewire.extras import optional_dependency
from inference.backends.base import BackendError, InferCall, ModelNotFound
from routing.types import Priority

with optional_dependency("gateway", "triton"):
    from tritonclient.utils import InferenceServerException


@dataclass(frozen=True, slots=True)
class ServerAnswer:
    """A failed call as the server answered it: the gRPC status name and its message."""

    code: str  # "UNAVAILABLE", "RESOURCE_EXHAUSTED", ...
    message: str

    @classmethod
    def of(cls, exc: InferenceServerException) -> ServerAnswer:
        """The answer tritonclient's exception carries (its status reads ``StatusCode.NAME``)."""
        status = exc.status() or ""
        return cls(code=status.removeprefix("StatusCode."), message=exc.message() or "")


class Dialect(Protocol):
    """What differs between servers that speak KServe v2: headers, priorities, error meanings."""

    kind: str  # "triton" | "rayserve": log field and error prefix

    def headers(self) -> Mapping[str, str]: ...

    def priority(self, priority: Priority, levels: int) -> int:
        """The request's priority parameter for a model with ``levels`` priority levels (0 = none)."""
        ...

    def error(self, answer: ServerAnswer, call: InferCall) -> BackendError:
        """The BackendError a failed call becomes (overloaded, deadline, retryable or not)."""
        ...


def common_error(answer: ServerAnswer, call: InferCall, where: str) -> BackendError:
    """The meaning of the gRPC status codes every KServe v2 server shares."""
    detail = f"{where}: {answer.code}: {answer.message}"
    if answer.code == "RESOURCE_EXHAUSTED":
        return BackendError(detail, retryable=True, overloaded=True, status="OVERLOADED")
    if answer.code == "DEADLINE_EXCEEDED":
        return BackendError(detail, retryable=False, status="DEADLINE_EXCEEDED")
    if answer.code == "NOT_FOUND":
        return ModelNotFound(call.model, call.version)
    if answer.code == "INVALID_ARGUMENT":
        return BackendError(detail, retryable=False, status="INVALID_ARGUMENT")
    if answer.code in ("UNAVAILABLE", "UNKNOWN", "CANCELLED", "ABORTED"):
        return BackendError(detail, retryable=True, status="UNAVAILABLE")
    return BackendError(detail, retryable=False, status="INTERNAL")
