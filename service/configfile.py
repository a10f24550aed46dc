"""The one way both programs load their config: defaults, then a TOML file, then environment variables,
then command-line flags, validated in one step against the program's typed schema.

``hk-gateway`` and ``edge-agent`` each declare one schema (``gateway.config.GatewayConfig``,
``edge_agent.config.AgentConfig``) and call :func:`load_config` with it; it returns the validated config
or raises :class:`ConfigError` listing every bad key by its dotted path (``carriers[1].bind``,
``backends.gpu0.call_timeout_s``, ``routing.pools[0].tier``) with its message. Library code only raises;
the command lines turn the error into exit code 2.

Why pydantic and not msgspec: a config is read once per start or reload, so msgspec's decoding speed buys
nothing here, while what a config needs pydantic has: every error of a file at once, each with its full
location (msgspec stops at the first error); ``Literal`` and ``Enum`` fields that mirror the code's fixed
choices one for one, with the allowed values in the message; validators that check across keys and report
at the key they concern (a ``ValidationError`` raised inside a validator is merged under the validator's
location by pydantic-core); lax parsing of the strings environment variables carry. It is also already a
dependency of both programs (and of the routing policy's own section), where msgspec would be a second.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

Config = TypeVar("Config", bound=BaseModel)
Location = tuple[int | str, ...]


class ConfigError(ValueError):
    """An invalid config. ``problems`` holds every (key path, message) pair; the file's own problems are
    keyed ``(file)`` (cannot be read) and ``(toml)`` (not TOML)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{key}: {message}" for key, message in problems))

    @property
    def key(self) -> str:
        """The first bad key."""
        return self.problems[0][0]


class ConfigFileError(ConfigError):
    """A config file that cannot be read or parsed; ``key`` is ``(file)`` or ``(toml)``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__([(key, message)])
        self.message = message


def load_config(
    schema: type[Config],
    *,
    defaults: Mapping[str, Any],
    path: Path | None,
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    file_replaces: Collection[str] = (),
) -> Config:
    """``defaults`` < the TOML file at ``path`` < ``{env_prefix}*`` variables (``os.environ`` unless given)
    < ``overrides`` (the command line's), then :func:`validate`. A top-level key in ``file_replaces`` that the
    file sets replaces the default wholesale instead of merging into it (a file's own carriers, say)."""
    raw = dict(defaults)
    if path is not None:
        from_file = read_toml(path)
        for key in file_replaces:
            if key in from_file:
                raw.pop(key, None)
        raw = merge_tables(raw, from_file)
    raw = merge_tables(raw, env_overrides(os.environ if environ is None else environ, env_prefix))
    if overrides:
        raw = merge_tables(raw, overrides)
    return validate(schema, raw)


def validate(schema: type[Config], raw: Mapping[str, Any]) -> Config:
    """Validate a merged mapping in one step; raises :class:`ConfigError` naming every bad key."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(validation_problems(exc)) from None


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file as tables; raises :class:`ConfigFileError`."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigFileError("(file)", exc.strerror or str(exc)) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError("(toml)", f"not valid TOML: {exc}") from None


def merge_tables(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge tables; lists and scalars in ``override`` replace those in ``base``."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_tables(out[key], value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """``HKGW_HTTP__PORT=9200`` -> ``{"http": {"port": "9200"}}`` (pydantic coerces the strings)."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(prefix) or not re.fullmatch(r"[A-Z0-9_]+", name):
            continue
        path = [p.lower() for p in name.removeprefix(prefix).split("__") if p]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if path:
            node[path[-1]] = value
    return out


def key_path(loc: Location) -> str:
    """pydantic's error location as a config key: ``carriers[1].bind``, ``routing.regions.mars``."""
    path = ""
    for part in loc:
        if part == "[key]":
            continue  # pydantic's marker for "the key itself was bad": the key is already in the path
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


def validation_problems(exc: ValidationError) -> list[tuple[str, str]]:
    """(key path, message) for each error, without pydantic's redundant 'too short' echo of a list
    whose items failed."""
    errors = exc.errors(include_url=False)
    out = []
    for err in errors:
        loc = err["loc"]
        if err["type"] == "too_short" and any(e["loc"][: len(loc)] == loc != e["loc"] for e in errors):
            continue
        out.append((key_path(loc), _message(err)))
    return out


def _message(err: Mapping[str, Any]) -> str:
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ValueError):
        return str(cause)
    if err["type"] == "missing":
        return "required"
    if err["type"] == "extra_forbidden":
        return "unknown key"
    message = str(err["msg"])
    return (
        "must be " + message.removeprefix("Input should be ")
        if message.startswith("Input should be ")
        else message
    )


def invalid(title: str, problems: Iterable[tuple[Location, str]]) -> ValidationError:
    """One error per (location, message), for a validator that checks across keys: raised inside it, each
    is reported at the location given, below the validator's own (``pools.cpu.backend``)."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(type=PydanticCustomError("config", message), loc=loc, input=None)
            for loc, message in problems
        ],
    )
