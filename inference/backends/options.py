"""A backend's config section as a typed model: one pydantic model per backend ``type``, in a registry.

Each backend declares its options as a :class:`BackendOptions` model and registers it under its config
``type`` with :func:`backend_options` (the same key as its factory in :mod:`inference.backends.base`). The
gateway's config validates every ``[backends.<name>]`` table with the model its ``type`` names, as part of
its one validation step, so a bad option is reported by its dotted path
(``backends.gpu0.call_timeout_s: must be a number of seconds > 0, got 0``) by ``hk-gateway check-config``,
not when the daemon starts. Code that builds a backend outside the gateway's config (the edge agent's
local tier, a Ray Serve replica, tests) reads the same model with :meth:`BackendOptions.from_mapping`,
whose :class:`BackendOptionsError` names the backend and the option.

The field markers below (:func:`integer`, :func:`seconds`, :func:`flag`, :func:`text`, :func:`version`)
hold the checks and the wording every backend shares. Values from ``HKGW_*`` environment variables arrive
as strings and are parsed as their TOML form would be; a boolean is never taken for a number.

A validator here reports a problem at its own key by raising a ``ValidationError`` with that location;
pydantic-core merges it into the enclosing error under the enclosing location (its ``convert_err``), so
the gateway's config sees ``backends.<name>.<key>``. This module cannot use the program-side helpers in
``service.configfile``: ``inference`` imports nothing of ``service`` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

UNKNOWN_OPTION = "unknown_option"
"""The error type of a key the backend does not take."""
INVALID_OPTION = "invalid_option"
"""The error type of a value the backend does not take."""

Location = tuple[int | str, ...]


def invalid(title: str, problems: Iterable[tuple[Location, str, Any]]) -> ValidationError:
    """A ValidationError with one error per (location, message, input); raised inside a validator, its
    locations are appended to the validator's own."""
    return ValidationError.from_exception_data(title, _details(problems, INVALID_OPTION))


def option_path(loc: Location) -> str:
    """An error location within a section as a dotted key: ``pins.rank-mlp``, ``models[0]``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


class BackendOptionsError(ValueError):
    """A backend section refused. ``problems`` holds (option, message) pairs, the option as its dotted
    path within the section; :meth:`keys` names them as the gateway config does
    (``backends.<name>.<option>``)."""

    def __init__(self, backend: str, problems: list[tuple[str, str]]) -> None:
        self.backend = backend
        self.problems = problems
        super().__init__("; ".join(_sentence(backend, key, message) for key, message in problems))

    def keys(self) -> list[str]:
        """The bad keys as dotted config paths."""
        return [f"backends.{self.backend}.{key}" for key, _ in self.problems]


def _sentence(backend: str, key: str, message: str) -> str:
    if message.startswith("unknown option"):
        return f"backend {backend!r}: unknown option {key!r}{message.removeprefix('unknown option')}"
    return f"backend {backend!r}: option {key!r} {message}"


def _worded(error: Mapping[str, Any]) -> str:
    """pydantic's own messages in the wording of this module's ("must be ...", "is required")."""
    if error["type"] == "missing":
        return "is required"
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ValueError):
        return str(cause)
    message: str = error["msg"]
    if message.startswith("Input should be "):
        return "must be " + message.removeprefix("Input should be ")
    return message


class BackendOptions(BaseModel):
    """Base of every backend's options model: config keys are its fields; a key it does not take is an
    error listing the ones it does; validated values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def known_options(cls) -> list[str]:
        """The config keys this backend takes."""
        return sorted(field.alias or name for name, field in cls.model_fields.items())

    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        """Every problem of the section at once, unknown keys among them, in this module's wording."""
        if not isinstance(data, Mapping):
            return handler(data)
        known = set(cls.known_options())
        unknown = [key for key in data if key not in known]
        refused: list[tuple[Location, str, Any]] = []
        try:
            validated = handler({k: v for k, v in data.items() if k in known} if unknown else data)
        except ValidationError as exc:
            refused = [(tuple(e["loc"]), _worded(e), e.get("input")) for e in exc.errors(include_url=False)]
        if not unknown and not refused:
            return validated
        listed = f"unknown option; known: {', '.join(cls.known_options())}"
        raise ValidationError.from_exception_data(
            cls.__name__,
            [
                *_details((((key,), listed, data[key]) for key in unknown), UNKNOWN_OPTION),
                *_details(refused, INVALID_OPTION),
            ],
        )

    @classmethod
    def from_mapping(cls, backend: str, options: Mapping[str, Any]) -> Self:
        """Validate a section outside the gateway's config; raises :class:`BackendOptionsError`."""
        try:
            return cls.model_validate(options)
        except ValidationError as exc:
            problems = [(option_path(tuple(e["loc"])), str(e["msg"])) for e in exc.errors(include_url=False)]
            raise BackendOptionsError(backend, problems) from None


def _details(problems: Iterable[tuple[Location, str, Any]], kind: str) -> list[InitErrorDetails]:
    return [InitErrorDetails(type=PydanticCustomError(kind, m), loc=loc, input=v) for loc, m, v in problems]


Options = TypeVar("Options", bound=BackendOptions)
_REGISTRY: dict[str, type[BackendOptions]] = {}


def backend_options(type_name: str) -> Callable[[type[Options]], type[Options]]:
    """Register the options model of the backend ``type`` (``onnx``, ``null``, ``triton``, ...)."""

    def wrap(model: type[Options]) -> type[Options]:
        if type_name in _REGISTRY:
            raise ValueError(f"backend type {type_name!r} has options registered twice")
        _REGISTRY[type_name] = model
        return model

    return wrap


def as_toml(value: Any) -> str:
    """A refused value as the operator wrote it in TOML (``true``, ``"latest"``, ``[1, 2]``), not a repr."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(as_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {as_toml(item)}" for key, item in value.items()) + "}"
    return str(value)


def options_model(type_name: str) -> type[BackendOptions]:
    """The options model of a backend type; a LookupError for a type nothing registered."""
    try:
        return _REGISTRY[type_name]
    except KeyError:
        raise LookupError(f"unknown type {type_name!r}; known: {', '.join(option_types())}") from None


def option_types() -> list[str]:
    """The backend types with a registered options model."""
    return sorted(_REGISTRY)


def _refused(message: str) -> PydanticCustomError:
    return PydanticCustomError(INVALID_OPTION, message)


def integer(*, minimum: int = 1, maximum: int | None = None) -> WrapValidator:
    """Marker of an integer option in ``[minimum, maximum]``: ``Annotated[int, integer(maximum=64)]``."""
    if maximum is not None:
        kind = f"an integer in {minimum}..{maximum}"
    else:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> int:
        if not isinstance(value, bool):
            try:
                number: int = handler(value)
            except ValidationError:
                pass
            else:
                if number >= minimum and (maximum is None or number <= maximum):
                    return number
        raise _refused(f"must be {kind}, got {as_toml(value)}")

    return WrapValidator(check)


def seconds(*, zero_allowed: bool = False) -> WrapValidator:
    """Marker of a duration in seconds, > 0 (or >= 0 where zero means "never")."""
    bound = "a number >= 0" if zero_allowed else "a number of seconds > 0"

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> float:
        if not isinstance(value, bool):
            try:
                number: float = handler(value)
            except ValidationError:
                pass
            else:
                if number > 0 or (number == 0 and zero_allowed):
                    return number
        raise _refused(f"must be {bound}, got {as_toml(value)}")

    return WrapValidator(check)


def flag() -> WrapValidator:
    """Marker of a boolean option: TOML's true or false (``"true"`` / ``"false"`` from the environment)."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _refused(f"must be true or false, got {as_toml(value)}")

    return WrapValidator(check)


def text() -> WrapValidator:
    """Marker of a non-empty string option."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        if isinstance(value, str) and value:
            return value
        raise _refused(f"must be a non-empty string, got {as_toml(value)}")

    return WrapValidator(check)


def version(*, numeric: bool = False) -> WrapValidator:
    """Marker of a model version (a pin's value): a name or a number, kept as a string; ``numeric`` for
    servers whose versions are numbers only."""
    kind = "a version number" if numeric else "a version (a name or a number)"

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> str:
        as_text = str(value) if isinstance(value, int | str) and not isinstance(value, bool) else ""
        if as_text and (not numeric or as_text.isdecimal()):
            return as_text
        raise _refused(f"must be {kind}, got {as_toml(value)}")

    return WrapValidator(check)
