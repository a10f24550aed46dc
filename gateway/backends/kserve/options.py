"""The config section of a KServe v2 gRPC backend (``triton``, ``rayserve``), validated when it is read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.backends.kserve.tls import TlsOptions
from inference.backends.options import integer, refuse_unknown, seconds

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
