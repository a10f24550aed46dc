"""Reading a backend's config section: each bad value is a ValueError naming the backend and the key."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any


def refuse_unknown(backend: str, options: Mapping[str, Any], known: Set[str]) -> None:
    """A key the backend does not take is an error, not silently ignored."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"backend {backend!r}: unknown option {unknown[0]!r}; known: {sorted(known)}")


def integer(
    backend: str,
    options: Mapping[str, Any],
    key: str,
    default: int,
    *,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """An integer option in ``[minimum, maximum]``."""
    value = options.get(key, default)
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        kind = f"an integer in {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"
        if maximum is None and minimum == 1:
            kind = "a positive integer"
        raise ValueError(f"backend {backend!r}: option {key!r} must be {kind}, got {value!r}")
    return value


def seconds(
    backend: str, options: Mapping[str, Any], key: str, default: float, *, zero_allowed: bool = False
) -> float:
    """A duration in seconds, > 0 (or >= 0 where zero means "never")."""
    value = options.get(key, default)
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or value < 0
        or (value == 0 and not zero_allowed)
    ):
        bound = "a number >= 0" if zero_allowed else "a number of seconds > 0"
        raise ValueError(f"backend {backend!r}: option {key!r} must be {bound}, got {value!r}")
    return float(value)
