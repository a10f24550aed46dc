"""The config section of a KServe v2 gRPC backend (``triton``, ``rayserve``), validated when it is read."""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import Field, ValidatorFunctionWrapHandler, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from gateway.backends.kserve.tls import TlsOptions
from inference.backends.options import (
    INVALID_OPTION,
    BackendOptions,
    Location,
    flag,
    integer,
    invalid,
    seconds,
    text,
    version,
)


def _grpc_endpoint() -> WrapValidator:
    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        if isinstance(value, str) and ":" in value and "://" not in value:
            return value
        raise PydanticCustomError(INVALID_OPTION, f"must be HOST:PORT of the gRPC endpoint, got {value!r}")

    return WrapValidator(check)


class KServeOptions(BackendOptions):
    """Options shared by the KServe v2 gRPC backends (config keys of the same names)."""

    url: Annotated[str, _grpc_endpoint()]  # host:port of the server's gRPC endpoint
    channels: Annotated[int, integer(maximum=64)] = 2  # gRPC connections, used round-robin
    models: tuple[
        Annotated[str, text()], ...
    ] = ()  # serve only these; () = every model the server has loaded
    pins: dict[str, Annotated[str, version(numeric=True)]] = Field(
        default_factory=dict
    )  # model -> default version
    health_interval_s: Annotated[float, seconds()] = 1.0
    call_timeout_s: Annotated[float, seconds()] = 30.0  # upper bound of a call without a deadline
    control_timeout_s: Annotated[float, seconds()] = 2.0  # readiness, index and config calls
    # TLS (tls = true; plaintext gRPC without it): the server's CA (none = the host's CA file), a client
    # certificate and key for mutual TLS (both or neither), the name to check when url is an address.
    use_tls: Annotated[bool, flag()] = Field(default=False, alias="tls")
    tls_ca_file: Annotated[str, text()] | None = None
    tls_cert_file: Annotated[str, text()] | None = None
    tls_key_file: Annotated[str, text()] | None = None
    tls_server_name: Annotated[str, text()] | None = None

    @model_validator(mode="after")
    def _tls_options_together(self) -> Self:
        """A tls_* option without tls = true, or half a client pair, is refused at its own key."""
        given = {
            key: value
            for key, value in (
                ("tls_ca_file", self.tls_ca_file),
                ("tls_cert_file", self.tls_cert_file),
                ("tls_key_file", self.tls_key_file),
                ("tls_server_name", self.tls_server_name),
            )
            if value is not None
        }
        problems: list[tuple[Location, str, Any]] = []
        if not self.use_tls:
            problems += [((key,), "needs tls = true", value) for key, value in sorted(given.items())]
        elif ("tls_cert_file" in given) != ("tls_key_file" in given):
            missing = "tls_key_file" if "tls_cert_file" in given else "tls_cert_file"
            pair = "is required: tls_cert_file and tls_key_file go together (mutual TLS)"
            problems.append(((missing,), pair, None))
        if problems:
            raise invalid(type(self).__name__, problems)
        return self

    @property
    def tls(self) -> TlsOptions | None:
        """TLS to the server, or None for plaintext gRPC; its files are read when the backend starts."""
        if not self.use_tls:
            return None
        return TlsOptions(
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            server_name=self.tls_server_name,
        )
