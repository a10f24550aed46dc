"""The KServe v2 gRPC backend: connections to one remote server and the calls made over them.

The client is tritonclient's asyncio gRPC client, ``channels`` of them (one HTTP/2 connection each) used
round-robin. What the server serves is its :class:`~gateway.backends.kserve.catalog.ModelCatalog`, checked
every ``health_interval_s`` in the background (versions loaded since are picked up).

Tensors: each input is copied once into the request's raw bytes (protobuf needs bytes); each output is a
read-only numpy view over the response's bytes, no copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from typing import Any, Final

from edgewire.extras import optional_dependency
from gateway.backends.kserve.catalog import ModelCatalog
from gateway.backends.kserve.dialect import Dialect, ServerAnswer
from gateway.backends.kserve.options import KServeOptions
from inference.backends.base import (
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelNotFound,
    ModelSpec,
)

with optional_dependency("gateway", "triton"):
    import tritonclient.grpc.aio as triton_aio
    from tritonclient.grpc import InferInput
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

MAX_MESSAGE_BYTES: Final = 64 << 20


class KServeBackend:
    """A remote KServe v2 gRPC server behind a pool; see the module docstring.

    ``start`` does not fail when the server is down: the backend reports NOT_SERVING and keeps checking,
    so a gateway starts while one of its inference servers is being restarted.
    """

    def __init__(
        self,
        name: str,
        options: KServeOptions,
        dialect: Dialect,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.options = options
        self.dialect = dialect
        self._headers = dict(dialect.headers()) or None  # the same for every call
        self._clock = clock
        self._clients: list[Any] = []  # tritonclient.grpc.aio.InferenceServerClient (no type information)
        self._next = itertools.count()
        self._catalog = ModelCatalog(name, options, dialect.kind)
        self._health_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False

    @property
    def refresh_failures(self) -> int:
        """Readiness or model checks that failed (the server stays NOT_SERVING until one succeeds);
        exported as ``hkgw_backend_check_failures_total``."""
        return self._catalog.failures

    async def start(self) -> None:
        """Connect, read what the server serves, and keep checking it in the background."""
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} is closed")
        if self._started:
            return
        tls = self.options.tls
        credentials = None
        if tls is not None:  # an unreadable file fails the start, before anything connects
            try:
                credentials = tls.credentials()
            except ValueError as exc:
                raise ValueError(f"backend {self.name!r}: {exc}") from None
        self._started = True
        channel_args: list[tuple[str, int | str]] = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # Pings only while calls are under way: a dead connection fails its calls within seconds.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 0),
            # Reconnect within a second of a server restart (gRPC's default backoff grows to 120 s).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls is not None and tls.server_name:
            channel_args.append(("grpc.ssl_target_name_override", tls.server_name))
        for i in range(self.options.channels):
            # A local subchannel pool per client: gRPC would otherwise share one connection among them.
            args = [
                *channel_args,
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.primary_user_agent", f"hk-gateway/{i}"),
            ]
            self._clients.append(
                triton_aio.InferenceServerClient(self.options.url, creds=credentials, channel_args=args)
            )
        await self.refresh()
        self._health_task = asyncio.create_task(self._check_periodically(), name=f"{self.name}-health")

    async def infer(self, call: InferCall) -> InferResult:
        """One call; the deadline goes to the server (its queue policy) and bounds the gRPC call."""
        if not self._started or self._closed:
            raise BackendError(f"backend {self.name!r} is not serving", retryable=True, status="UNAVAILABLE")
        if call.timeout_s is not None and call.timeout_s <= 0:
            raise BackendError(
                f"model {call.model}: deadline passed before the call",
                retryable=False,
                status="DEADLINE_EXCEEDED",
            )
        model = self._catalog.served.find(call.model, call.version)
        if model is None:
            raise ModelNotFound(call.model, call.version)
        inputs = []
        for name, array in call.inputs.items():
            tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        timeout_s = self.options.call_timeout_s if call.timeout_s is None else call.timeout_s
        client = self._clients[next(self._next) % len(self._clients)]
        try:
            result = await client.infer(
                call.model,
                inputs,
                model_version=model.spec.version,
                priority=self.dialect.priority(call.priority, model.priority_levels),
                # Triton drops a request still queued when this passes (queue policy REJECT): the answer
                # comes back at the deadline, not after the work is done for nobody.
                timeout=max(1, int(timeout_s * 1e6)),
                client_timeout=timeout_s,
                headers=self._headers,
            )
        except InferenceServerException as exc:
            raise self.dialect.error(ServerAnswer.of(exc), call) from None
        response = result.get_response()
        outputs = {spec.name: result.as_numpy(spec.name) for spec in model.spec.outputs}
        missing = [name for name, array in outputs.items() if array is None]
        if missing:
            raise BackendError(
                f"{self.dialect.kind} {self.name}: model {call.model} answered without {missing}",
                retryable=False,
                status="INTERNAL",
            )
        return InferResult(outputs=outputs, model_version=response.model_version or model.spec.version)

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        """The spec of a served model version ("" = the pinned or latest one), or None."""
        found = self._catalog.served.find(name, version)
        return None if found is None else found.spec

    def models(self) -> list[ModelSpec]:
        """Every served model version's spec."""
        return [m.spec for m in self._catalog.served.entries.values()]

    def health(self) -> BackendHealth:
        """SERVING while the server is ready and at least one of its models is."""
        if self._closed or not self._catalog.serving:
            return BackendHealth.NOT_SERVING
        return BackendHealth.SERVING

    async def refresh(self) -> None:
        """Check readiness now and pick up models loaded or unloaded since the last check."""
        if self._clients:
            await self._catalog.refresh(self._clients, self._headers)

    async def aclose(self) -> None:
        """Stop checking and close the connections; calls under way are cancelled. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await asyncio.gather(*(client.close() for client in self._clients), return_exceptions=True)
        self._clients.clear()

    async def _check_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            await self.refresh()
