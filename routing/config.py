"""The ``[routing]`` section of the gateway and agent config: schema, validation, and the demo default.

:class:`RoutingConfig` is a field of both programs' schemas, so their one validation step
(``service.configfile``) checks it with the rest and names a bad key by its path
(``routing.pools[2].tier: ...``). Cross-references (a pool naming a model that is not configured, a pin
naming a pool that does not serve the model) are checked in the same step and reported at their own keys.
:func:`load_routing_config` validates the section alone (a policy reload, the tests) and raises
:class:`RoutingConfigError` with the same paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from routing.regions import RegionName
from routing.types import Priority, RequestKind, Tier


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Thresholds(_Section):
    """Score boundaries between tiers: below ``edge_server`` stays on the device, from ``cloud`` up goes
    to the cloud, in between goes to the Hong Kong edge servers."""

    edge_server: float = Field(default=0.3, ge=0.0, le=1.0)
    cloud: float = Field(default=0.7, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.edge_server > self.cloud:
            raise ValueError(f"edge_server ({self.edge_server}) must not exceed cloud ({self.cloud})")
        return self


class WorkScale(_Section):
    """Work units of one request kind that map to score 0 (``floor``) and score 1 (``ceiling``).

    The score is log-linear in between: work spans orders of magnitude, and a doubling of work should move
    the score by the same step whether the request is small or large.
    """

    floor: float = Field(gt=0.0)
    ceiling: float = Field(gt=0.0)

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.floor >= self.ceiling:
            raise ValueError(f"floor ({self.floor}) must be below ceiling ({self.ceiling})")
        return self


class CostModelConfig(_Section):
    """Static cost model: work per request kind -> score, and score <-> service time on a speed-1.0 pool."""

    ranking: WorkScale = WorkScale(floor=256, ceiling=4_194_304)
    """Work = candidates x feature width."""
    text: WorkScale = WorkScale(floor=8, ceiling=2048)
    """Work = tokens."""
    image: WorkScale = WorkScale(floor=1024, ceiling=16_777_216)
    """Work = pixels."""
    tensor: WorkScale = WorkScale(floor=256, ceiling=16_777_216)
    """Work = input elements."""
    chars_per_token: float = Field(default=4.0, gt=0.0)
    latency_floor_s: float = Field(default=0.001, gt=0.0)
    """Service time of a score-0 request on a speed-1.0 pool."""
    latency_ceiling_s: float = Field(default=0.5, gt=0.0)
    """Service time of a score-1 request on a speed-1.0 pool."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.latency_floor_s >= self.latency_ceiling_s:
            raise ValueError(
                f"latency_floor_s ({self.latency_floor_s}) must be below latency_ceiling_s "
                f"({self.latency_ceiling_s})"
            )
        return self


class CalibrationConfig(_Section):
    """How observed latencies feed back into the score."""

    enabled: bool = True
    alpha: float = Field(default=0.2, gt=0.0, le=1.0)
    """EWMA weight of each new observation."""
    min_samples: int = Field(default=8, ge=1)
    """Observations of a (model, size bucket) before they influence its score."""
    weight: float = Field(default=1.0, ge=0.0, le=1.0)
    """Share of the calibrated score in the blend with the static estimate."""


class ModelConfig(_Section):
    """Per-model policy."""

    kind: RequestKind
    """The request kind this model takes (the gateway checks requests against it)."""
    thresholds: Thresholds | None = None
    """Overrides the global thresholds for this model."""
    cost_factor: float = Field(default=1.0, gt=0.0)
    """Multiplies the request's work: a heavier model of the same kind costs more per unit."""
    on_device: bool = True
    """Whether edge agents can serve this model locally (the edge device tier)."""
    pin_tier: Tier | None = None
    """Serve only on this tier, whatever the score."""
    pin_pool: str | None = None
    """Serve only on this pool, whatever the score."""
    version_pins: dict[str, str] = Field(default_factory=dict)
    """Model version -> the only pool that serves it (e.g. a canary)."""


class PoolConfig(_Section):
    """One named backend pool."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")
    tier: Tier
    models: tuple[str, ...] = Field(min_length=1)
    priorities: tuple[Priority, ...] = (Priority.REALTIME, Priority.INTERACTIVE, Priority.BATCH)
    """Priority classes the pool takes: low-latency pools take realtime, throughput pools take batch."""
    speed: float = Field(default=1.0, gt=0.0)
    """Throughput relative to the reference CPU pool (1.0)."""
    concurrency: int = Field(default=1, ge=1)
    """Items served at once when the live signals do not say."""
    max_queue_depth: int = Field(default=64, ge=1)
    """Queue depth at which the pool counts as saturated."""

    @field_validator("tier")
    @classmethod
    def _not_device(cls, tier: Tier) -> Tier:
        if tier is Tier.EDGE_DEVICE:
            raise ValueError("edge_device is served by the edge agent itself, not by a pool")
        return tier

    @field_validator("priorities")
    @classmethod
    def _distinct(cls, priorities: tuple[Priority, ...]) -> tuple[Priority, ...]:
        if not priorities:
            raise ValueError("a pool must take at least one priority class")
        if len(set(priorities)) != len(priorities):
            raise ValueError("a priority class is listed twice")
        return priorities


class RegionOverride(_Section):
    """Policy for requests attributed to one region."""

    thresholds: Thresholds | None = None
    """Overrides both the global and the per-model thresholds in this region."""
    pools: tuple[str, ...] | None = None
    """The only pools requests from this region may use; None = all."""


class RoutingConfig(_Section):
    """The validated ``[routing]`` section."""

    thresholds: Thresholds = Thresholds()
    models: dict[str, ModelConfig] = Field(min_length=1)
    pools: tuple[PoolConfig, ...] = Field(min_length=1)
    regions: dict[RegionName, RegionOverride] = Field(default_factory=dict)
    cost: CostModelConfig = CostModelConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    deadline_slack_s: float = Field(default=0.0, ge=0.0)
    """Time kept in reserve for the reply's trip back; a pool must finish this much before the deadline."""
    spill_down: bool = True
    """Whether a request may spill to a lower tier when its tier and those above it cannot serve it."""
    geoip_db: str | None = None
    """Path of a MaxMind country or city database; the caller opens it."""

    @model_validator(mode="after")
    def _references(self) -> Self:
        """Names that must match (a pool's models, a pin's pool), each reported at its own key: raised
        inside the validator, pydantic-core files the errors under the section's own location."""
        problems = _reference_problems(self)
        if problems:
            raise ValidationError.from_exception_data(
                "RoutingConfig",
                [
                    InitErrorDetails(type=PydanticCustomError("reference", message), loc=loc, input=None)
                    for loc, message in problems
                ],
            )
        return self


Location = tuple[int | str, ...]


def _reference_problems(cfg: RoutingConfig) -> list[tuple[Location, str]]:
    problems: list[tuple[Location, str]] = []
    pools: dict[str, PoolConfig] = {}
    for i, pool in enumerate(cfg.pools):
        if pool.name in pools:
            problems.append((("pools", i, "name"), f"duplicate pool name {pool.name!r}"))
        pools[pool.name] = pool
        for j, model_name in enumerate(pool.models):
            if model_name not in cfg.models:
                problems.append(
                    (("pools", i, "models", j), f"unknown model {model_name!r} (not under models)")
                )
    for name, model in cfg.models.items():
        problems.extend(_pin_problems(cfg, pools, name, model))
    for region, override in cfg.regions.items():
        for j, pool_name in enumerate(override.pools or ()):
            if pool_name not in pools:
                problems.append((("regions", region, "pools", j), f"unknown pool {pool_name!r}"))
    return problems


def _pin_problems(
    cfg: RoutingConfig, pools: dict[str, PoolConfig], name: str, model: ModelConfig
) -> list[tuple[Location, str]]:
    problems: list[tuple[Location, str]] = []
    base: Location = ("models", name)

    def serving(pool_name: str, path: Location) -> PoolConfig | None:
        pool = pools.get(pool_name)
        if pool is None:
            problems.append((path, f"unknown pool {pool_name!r}"))
            return None
        if name not in pool.models:
            problems.append((path, f"pool {pool_name!r} does not serve model {name!r}"))
            return None
        return pool

    pinned = serving(model.pin_pool, (*base, "pin_pool")) if model.pin_pool is not None else None
    for version, pool_name in model.version_pins.items():
        serving(pool_name, (*base, "version_pins", version))
    tier = model.pin_tier
    if tier is None:
        return problems
    if pinned is not None and pinned.tier is not tier:
        problems.append(((*base, "pin_tier"), f"pin_pool {pinned.name!r} is on tier {pinned.tier}"))
    elif tier is Tier.EDGE_DEVICE and not model.on_device:
        problems.append(((*base, "pin_tier"), "pinned to edge_device but on_device is false"))
    elif tier is not Tier.EDGE_DEVICE and not any(p.tier is tier and name in p.models for p in cfg.pools):
        problems.append(((*base, "pin_tier"), f"no pool on tier {tier} serves this model"))
    return problems


class RoutingConfigError(ValueError):
    """The routing section is invalid. ``problems`` holds (key path, message) pairs; the text lists them."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("\n".join(f"{path}: {msg}" for path, msg in problems))
        self.problems = problems

    @property
    def key(self) -> str:
        """Path of the first bad key."""
        return self.problems[0][0]


def _key_path(section: str, loc: tuple[int | str, ...]) -> str:
    path = section
    for part in loc:
        if part == "[key]":
            continue  # pydantic's marker for "the key itself was bad"; the key is already in the path
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def load_routing_config(mapping: Mapping[str, Any], *, section: str = "routing") -> RoutingConfig:
    """Validate the ``[routing]`` section (as parsed from TOML or built in code).

    Raises :class:`RoutingConfigError` naming each bad key as ``section.path[index].key``: the same paths
    and messages as the programs' loader (``service.configfile``, which ``routing`` may not import).
    """
    try:
        return RoutingConfig.model_validate(mapping)
    except ValidationError as exc:
        problems: list[tuple[str, str]] = []
        errors = exc.errors(include_url=False)
        for err in errors:
            loc = err["loc"]
            if err["type"] == "too_short" and any(e["loc"][: len(loc)] == loc != e["loc"] for e in errors):
                continue  # pydantic also counts the invalid items as missing; the item errors say it all
            cause = err.get("ctx", {}).get("error")
            msg = str(cause) if isinstance(cause, ValueError) else err["msg"]
            problems.append((_key_path(section, err["loc"]), msg))
        raise RoutingConfigError(problems) from None


_ALL_MODELS = ["rank-mlp", "text-encoder", "image-classifier"]

DEFAULT_ROUTING_SECTION: dict[str, Any] = {
    "thresholds": {"edge_server": 0.3, "cloud": 0.7},
    "models": {
        "rank-mlp": {"kind": "ranking"},
        "text-encoder": {"kind": "text"},
        "image-classifier": {"kind": "image"},
    },
    "pools": [
        {
            "name": "cpu",
            "tier": "edge_server",
            "models": _ALL_MODELS,
            "priorities": ["realtime", "interactive", "batch"],
            "speed": 1.0,
            "concurrency": 8,
            "max_queue_depth": 64,
        },
        {
            "name": "gpu-a100-mig",
            "tier": "cloud",
            "models": _ALL_MODELS,
            "priorities": ["realtime", "interactive"],
            "speed": 4.0,
            "concurrency": 4,
            "max_queue_depth": 32,
        },
        {
            "name": "gpu-a100",
            "tier": "cloud",
            "models": _ALL_MODELS,
            "priorities": ["interactive", "batch"],
            "speed": 8.0,
            "concurrency": 16,
            "max_queue_depth": 256,
        },
        {
            "name": "gpu-v100",
            "tier": "cloud",
            "models": ["text-encoder", "rank-mlp"],
            "priorities": ["interactive", "batch"],
            "speed": 5.0,
            "concurrency": 8,
            "max_queue_depth": 128,
        },
    ],
}
"""The demo's routing section as plain data (what a TOML ``[routing]`` table parses to)."""


def default_routing_config() -> RoutingConfig:
    """The demo policy: three models, a Hong Kong CPU pool and three cloud GPU pools, thresholds 0.3 / 0.7."""
    return load_routing_config(DEFAULT_ROUTING_SECTION)
