"""Carrier health for GeoDNS (and BGP): UP / DEGRADED / DRAINING / DOWN, with hysteresis.

The event loop evaluates health every ``interval_s`` and publishes an immutable snapshot; the HTTP thread
only reads the latest snapshot, so a health check is answered at once however busy the loop is, and a
snapshot that stops being refreshed (a wedged loop) reads as DOWN.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol


class CarrierState(enum.StrEnum):
    UP = "UP"
    DEGRADED = "DEGRADED"
    DRAINING = "DRAINING"
    DOWN = "DOWN"

    @property
    def http_status(self) -> int:
        return 200 if self in (CarrierState.UP, CarrierState.DEGRADED) else 503

    @property
    def gauge(self) -> float:
        return {CarrierState.UP: 1.0, CarrierState.DEGRADED: 0.5}.get(self, 0.0)


_BADNESS = {CarrierState.UP: 0, CarrierState.DEGRADED: 1, CarrierState.DOWN: 2}


@dataclass(frozen=True, slots=True)
class CarrierProbe:
    """One evaluation's raw facts about a carrier."""

    bound: bool
    receiving: bool
    stalled: bool
    disabled: bool = False


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """What the HTTP thread serves; replaced whole on each evaluation."""

    evaluated_at: float
    carriers: Mapping[str, CarrierState]
    details: Mapping[str, str]
    ready: bool
    draining: bool
    tiers: Mapping[str, bool] = field(default_factory=dict)


class Hysteresis:
    """A state that changes only after the new raw state held ``rise`` (better) or ``fall`` (worse) times.

    DRAINING is operator intent and applies at once; so does leaving it.
    """

    def __init__(self, rise: int, fall: int) -> None:
        self.rise = rise
        self.fall = fall
        self.state = CarrierState.DOWN
        self._candidate = CarrierState.DOWN
        self._count = 0
        self._first = True

    def update(self, raw: CarrierState) -> CarrierState:
        if self._first:  # the first evaluation is taken as it is: there is no history to flap against
            self._first = False
            self.state = self._candidate = raw
            return raw
        if raw is CarrierState.DRAINING or self.state is CarrierState.DRAINING:
            self.state = self._candidate = raw
            self._count = 0
            return self.state
        if raw is self.state:
            self._candidate, self._count = raw, 0
            return self.state
        if raw is not self._candidate:
            self._candidate, self._count = raw, 0
        self._count += 1
        needed = self.fall if _BADNESS[raw] > _BADNESS[self.state] else self.rise
        if self._count >= needed:
            self.state, self._count = raw, 0
        return self.state


def raw_state(
    probe: CarrierProbe,
    *,
    draining: bool,
    degraded: bool,
    why_degraded: str = "a tier has no healthy pool",
    serving: bool = True,
) -> tuple[CarrierState, str]:
    """The state one probe shows before hysteresis, with a short reason. ``serving``: some process can take
    the carrier's frames (with shards: some shard is alive and ready)."""
    if draining:
        return CarrierState.DRAINING, "gateway draining"
    if probe.disabled:
        return CarrierState.DRAINING, "carrier disabled by operator"
    if not probe.bound:
        return CarrierState.DOWN, "not bound"
    if not probe.receiving:
        return CarrierState.DOWN, "receive loop stopped"
    if probe.stalled:
        return CarrierState.DOWN, "input waiting, none read"
    if not serving:
        return CarrierState.DOWN, "no shard serving"
    if degraded:
        return CarrierState.DEGRADED, why_degraded
    return CarrierState.UP, "bound and passing traffic"


class Probed(Protocol):
    """What health reads of a carrier (gateway.ingress.carrier.Carrier has it)."""

    @property
    def bound(self) -> bool: ...

    @property
    def receiving(self) -> bool: ...

    def stalled(self, now: float, stall_s: float) -> bool: ...


class CarrierHealth:
    """Every carrier's state with hysteresis, and the carriers an operator disabled (in memory only): what
    one gateway process and a shards' front both evaluate each health interval."""

    def __init__(self, names: Iterable[str], rise: int, fall: int, stall_s: float) -> None:
        self._hysteresis = {name: Hysteresis(rise, fall) for name in names}
        self._stall_s = stall_s
        self.disabled: set[str] = set()

    def initial(self) -> HealthSnapshot:
        return HealthSnapshot(
            time.monotonic(),
            dict.fromkeys(self._hysteresis, CarrierState.DOWN),
            {},
            ready=False,
            draining=False,
        )

    def knows(self, name: str) -> bool:
        return name in self._hysteresis

    def set_enabled(self, name: str, enabled: bool) -> bool:
        if name not in self._hysteresis:
            return False
        (self.disabled.discard if enabled else self.disabled.add)(name)
        return True

    def evaluate(
        self,
        carriers: Mapping[str, Probed],
        now: float,
        *,
        draining: bool,
        degraded: bool,
        why_degraded: str = "a tier has no healthy pool",
        serving: bool = True,
    ) -> tuple[dict[str, CarrierState], dict[str, str]]:
        """Each carrier's state now (after hysteresis) and why."""
        states: dict[str, CarrierState] = {}
        details: dict[str, str] = {}
        for name, hysteresis in self._hysteresis.items():
            carrier = carriers.get(name)
            probe = CarrierProbe(
                bound=carrier is not None and carrier.bound,
                receiving=carrier is not None and carrier.receiving,
                stalled=carrier is None or carrier.stalled(now, self._stall_s),
                disabled=name in self.disabled,
            )
            raw, why = raw_state(
                probe, draining=draining, degraded=degraded, why_degraded=why_degraded, serving=serving
            )
            states[name] = hysteresis.update(raw)
            details[name] = why if states[name] is raw else f"{why} (holding {states[name].value})"
        return states, details
