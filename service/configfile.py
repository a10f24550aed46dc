"""Config-file mechanics shared by ``hk-gateway`` and ``edge-agent``: TOML reading, deep merge, environment
overrides and turning pydantic's errors into (key path, message) pairs."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError


class ConfigFileError(ValueError):
    """A config file that cannot be read or parsed; ``key`` is ``(file)`` or ``(toml)``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def read_toml(path: Path) -> dict[str, Any]:
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


def key_path(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a config key: ``carriers[1].bind``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


def validation_problems(exc: ValidationError) -> list[tuple[str, str, BaseException | None]]:
    """(key path, message, the validator's own exception if any) for each error, without pydantic's
    redundant 'list too short' echo of a list whose items failed."""
    errors = exc.errors(include_url=False)
    out = []
    for err in errors:
        loc = err["loc"]
        if err["type"] == "too_short" and any(e["loc"][: len(loc)] == loc != e["loc"] for e in errors):
            continue
        cause = err.get("ctx", {}).get("error")
        message = str(cause) if isinstance(cause, ValueError) else err["msg"]
        out.append((key_path(loc), message, cause if isinstance(cause, BaseException) else None))
    return out
