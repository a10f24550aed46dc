"""Backends that speak the KServe v2 gRPC protocol (``inference.GRPCInferenceService``) to a remote server.

Triton Inference Server speaks it natively and Ray Serve's gRPC proxy forwards it to a deployment
(``deploy/rayserve``), so both are one :class:`KServeBackend` with a :class:`Dialect` for what differs:
request headers, how a priority class becomes the server's priority level, and what the server's error
answers mean. The client is tritonclient's asyncio gRPC client, ``channels`` of them (one HTTP/2
connection each) used round-robin.

Models are discovered from the server: the repository index lists what is loaded, ``ModelConfig`` gives
each one's ``config.pbtxt`` (read by the same code as the embedded backend's repository), and a model
whose config enables ``dynamic_batching`` is batched by the server, not the gateway. A background task
checks ServerReady and ModelReady every ``health_interval_s`` and picks up versions loaded since.

Tensors: each input is copied once into the request's raw bytes (protobuf needs bytes); each output is a
read-only numpy view over the response's bytes, no copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

import grpc
import structlog
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from inference.backends.base import (
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelNotFound,
    ModelSpec,
    ServedVersions,
)
from inference.backends.modelrepo import ModelRepositoryError, spec_from_config
from inference.backends.options import integer, refuse_unknown, seconds
from routing.types import Priority

_log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES: Final = 64 << 20
_TLS_FILES: Final = ("tls_ca_file", "tls_cert_file", "tls_key_file")
_OPTIONS: Final = frozenset(
    {
        "url",
        "channels",
        "models",
        "pins",
        "health_interval_s",
        "call_timeout_s",
        "control_timeout_s",
        "tls",
        "tls_server_name",
        *_TLS_FILES,
    }
)


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """TLS to the inference server: its CA (None = the system's CA file, OpenSSL's default), a client
    certificate and key for mutual TLS (both or neither), and the name to check in the server's certificate
    when ``url`` is an address (``tls_server_name``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials. A file that cannot be read or is not what it should be (PEM
        certificates; a certificate and its own key) is a ValueError naming its option: gRPC would only
        fail every handshake later, with nothing said."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ca_file = self.ca_file
        if ca_file is None:  # grpcio would use its own bundled roots, not the host's
            system = ssl.get_default_verify_paths().cafile
            ca_file = system if system and Path(system).is_file() else None
        ca = _read("tls_ca_file", ca_file) if ca_file else None
        if ca is not None:
            try:
                context.load_verify_locations(cadata=ca.decode("latin-1"))
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(
                    f"option 'tls_ca_file': {ca_file} holds no PEM certificates ({exc})"
                ) from None
        cert = key = None
        if self.cert_file is not None and self.key_file is not None:
            cert, key = _read("tls_cert_file", self.cert_file), _read("tls_key_file", self.key_file)
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"options 'tls_cert_file', 'tls_key_file': {self.cert_file} and {self.key_file} are not"
                    f" a PEM certificate and its key ({exc})"
                ) from None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read(option: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"option {option!r}: cannot read {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class KServeOptions:
    """Options shared by the KServe v2 gRPC backends (config keys of the same names)."""

    url: str  # host:port of the server's gRPC endpoint
    channels: int = 2  # gRPC connections, used round-robin
    models: tuple[str, ...] = ()  # serve only these; () = every model the server has loaded
    pins: Mapping[str, str] = field(default_factory=dict)  # model -> version served by default
    health_interval_s: float = 1.0
    call_timeout_s: float = 30.0  # upper bound of a call without a deadline
    control_timeout_s: float = 2.0  # readiness, index and config calls
    tls: TlsOptions | None = None  # None = plaintext gRPC

    @classmethod
    def from_mapping(
        cls, backend: str, options: Mapping[str, Any], extra: frozenset[str] = frozenset()
    ) -> KServeOptions:
        """Read a config section; unknown keys and bad values are a ValueError naming the key."""
        known = _OPTIONS | extra
        refuse_unknown(backend, options, known)
        where = f"backend {backend!r}: option"
        url = options.get("url")
        if not isinstance(url, str) or ":" not in url or "://" in url:
            raise ValueError(f"{where} 'url' must be HOST:PORT of the gRPC endpoint, got {url!r}")
        models = options.get("models", [])
        if not isinstance(models, list | tuple) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"{where} 'models' must be a list of model names, got {models!r}")
        pins = options.get("pins", {})
        if not isinstance(pins, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str | int) and not isinstance(v, bool) and str(v).isdecimal()
            for k, v in pins.items()
        ):
            raise ValueError(f"{where} 'pins' must map model names to numeric versions, got {pins!r}")
        return cls(
            url=url,
            tls=_tls(where, options),
            channels=integer(backend, options, "channels", 2, maximum=64),
            models=tuple(models),
            pins={k: str(v) for k, v in pins.items()},
            health_interval_s=seconds(backend, options, "health_interval_s", 1.0),
            call_timeout_s=seconds(backend, options, "call_timeout_s", 30.0),
            control_timeout_s=seconds(backend, options, "control_timeout_s", 2.0),
        )


def _tls(where: str, options: Mapping[str, Any]) -> TlsOptions | None:
    """``tls = true`` and its files; a tls_* option without it, or half a client pair, is an error."""
    enabled = options.get("tls", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{where} 'tls' must be true or false, got {enabled!r}")
    given = {key: options[key] for key in (*_TLS_FILES, "tls_server_name") if key in options}
    for key, value in given.items():
        if not isinstance(value, str) or not value:
            raise ValueError(f"{where} {key!r} must be a non-empty string, got {value!r}")
    if not enabled:
        if given:
            raise ValueError(f"{where} {sorted(given)[0]!r} needs tls = true")
        return None
    if ("tls_cert_file" in given) != ("tls_key_file" in given):
        raise ValueError(f"{where} 'tls_cert_file' and 'tls_key_file' go together (mutual TLS)")
    return TlsOptions(
        ca_file=given.get("tls_ca_file"),
        cert_file=given.get("tls_cert_file"),
        key_file=given.get("tls_key_file"),
        server_name=given.get("tls_server_name"),
    )


@dataclass(frozen=True, slots=True)
class ServerAnswer:
    """A failed call as the server answered it: the gRPC status name and its message."""

    code: str  # "UNAVAILABLE", "RESOURCE_EXHAUSTED", ...
    message: str


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


@dataclass(frozen=True, slots=True)
class _Model:
    spec: ModelSpec
    priority_levels: int


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
        self._served: ServedVersions[_Model] = ServedVersions({}, {})
        self._server_ready = False
        self._ready_models: frozenset[tuple[str, str]] = frozenset()
        self._health_task: asyncio.Task[None] | None = None
        self._started = False
        self._closed = False
        self.refresh_failures = 0
        """Readiness or model checks that failed (the server stays NOT_SERVING until one succeeds);
        exported as ``hkgw_backend_check_failures_total``."""

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
        model = self._served.find(call.model, call.version)
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
            raise self.dialect.error(_answer(exc), call) from None
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
        found = self._served.find(name, version)
        return None if found is None else found.spec

    def models(self) -> list[ModelSpec]:
        """Every served model version's spec."""
        return [m.spec for m in self._served.entries.values()]

    def health(self) -> BackendHealth:
        """SERVING while the server is ready and at least one of its models is."""
        if self._closed or not self._server_ready or not self._ready_models:
            return BackendHealth.NOT_SERVING
        return BackendHealth.SERVING

    async def refresh(self) -> None:
        """Check readiness now and pick up models loaded or unloaded since the last check."""
        if not self._clients:
            return
        client = self._clients[0]
        headers = self._headers
        timeout = self.options.control_timeout_s
        try:
            # Every connection is asked, so that each one reconnects after a server restart before it is
            # given calls again (gRPC otherwise keeps an idle channel in reconnect backoff).
            answers = await asyncio.gather(
                *(c.is_server_ready(headers=headers, client_timeout=timeout) for c in self._clients)
            )
            self._server_ready = all(answers)
            if not self._server_ready:
                self._ready_models = frozenset()
                return
            index = await client.get_model_repository_index(headers=headers, client_timeout=timeout)
            listed = {
                (m.name, m.version)
                for m in index.models
                if m.state == "READY"
                and m.version
                and (not self.options.models or m.name in self.options.models)
            }
            if listed != set(self._served.entries):
                self._served = await self._read_models(client, listed, headers)
            ready = await asyncio.gather(
                *(
                    client.is_model_ready(name, version, headers=headers, client_timeout=timeout)
                    for name, version in self._served.entries
                )
            )
            self._ready_models = frozenset(
                key for key, ok in zip(self._served.entries, ready, strict=True) if ok
            )
        except (InferenceServerException, ModelRepositoryError) as exc:
            self.refresh_failures += 1
            if self._server_ready or self.refresh_failures == 1:  # a change, or never reached since start
                _log.warning(f"{self.dialect.kind} server check failed", backend=self.name, error=str(exc))
            self._server_ready = False
            self._ready_models = frozenset()

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

    async def _read_models(
        self, client: Any, listed: set[tuple[str, str]], headers: dict[str, str] | None
    ) -> ServedVersions[_Model]:
        models: dict[tuple[str, str], _Model] = {}
        for name, version in sorted(listed):
            previous = self._served.entries.get((name, version))
            if previous is not None:
                models[(name, version)] = previous
                continue
            answer = await client.get_model_config(
                name, version, headers=headers, client_timeout=self.options.control_timeout_s
            )
            config = answer.config
            where = Path(f"{self.dialect.kind}://{self.options.url}/{name}/config.pbtxt")
            spec = spec_from_config(config, version, where)
            levels = int(config.dynamic_batching.priority_levels) if spec.server_batching else 0
            models[(name, version)] = _Model(spec, levels)
        defaults: dict[str, str] = {}
        for name, version in models:
            pin = self.options.pins.get(name)
            if pin is not None:
                if (name, pin) in models:
                    defaults[name] = pin
                continue  # a pinned version that is not loaded is not served as another one
            if name not in defaults or int(version) > int(defaults[name]):
                defaults[name] = version
        added = sorted(set(models) - set(self._served.entries))
        if added:
            _log.info(
                f"{self.dialect.kind} models found", backend=self.name, models=[f"{m}/{v}" for m, v in added]
            )
        return ServedVersions(models, defaults)

    async def _check_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            await self.refresh()


def _answer(exc: InferenceServerException) -> ServerAnswer:
    status = exc.status() or ""
    return ServerAnswer(code=status.removeprefix("StatusCode."), message=exc.message() or "")
