"""The ``rayserve`` backend: a Ray Serve application behind Ray Serve's gRPC proxy, spoken to in KServe v2.

:mod:`inference.rayserve_app` is the application (``deploy/rayserve`` deploys it): it answers
``inference.GRPCInferenceService`` (ModelInfer, readiness, repository index, model config) from a deployment
that batches with ``@serve.batch``. The proxy picks the application from the ``application`` request header.
Ray Serve sheds load with RESOURCE_EXHAUSTED once a deployment's ``max_queued_requests`` is reached: that is
OVERLOADED, shed and retried elsewhere. Ray Serve has no priority levels; the deadline is the gRPC call's
deadline, which the proxy turns into a cancellation of the request at the replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from gateway.backends.kserve.backend import KServeBackend
from gateway.backends.kserve.dialect import ServerAnswer, common_error
from gateway.backends.kserve.options import KServeOptions
from inference.backends.base import Backend, BackendError, InferCall, register
from inference.backends.options import backend_options, text
from routing.types import Priority


@backend_options("rayserve")
class RayServeOptions(KServeOptions):
    """The ``rayserve`` backend's options: those of every KServe v2 backend and the Serve application."""

    application: Annotated[str, text()] = "hk-models"  # the request header Ray Serve's proxy routes by


class RayServeDialect:
    """Ray Serve's application header and error answers."""

    kind = "rayserve"

    def __init__(self, application: str) -> None:
        self.application = application

    def headers(self) -> Mapping[str, str]:
        return {"application": self.application}

    def priority(self, priority: Priority, levels: int) -> int:
        return 0

    def error(self, answer: ServerAnswer, call: InferCall) -> BackendError:
        where = f"rayserve application {self.application} model {call.model}"
        if answer.code == "NOT_FOUND" and "pplication" in answer.message:
            # The application itself is missing (being redeployed): the server, not the model, is at fault.
            return BackendError(f"{where}: {answer.message}", retryable=True, status="UNAVAILABLE")
        return common_error(answer, call, where)


@register("rayserve")
def create_rayserve_backend(name: str, options: Mapping[str, Any]) -> Backend:
    """Factory for ``type = "rayserve"``: a KServe v2 gRPC backend with Ray Serve's dialect."""
    read = RayServeOptions.from_mapping(name, options)
    return KServeBackend(name, read, RayServeDialect(read.application))
