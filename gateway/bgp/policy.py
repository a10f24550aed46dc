"""Pure policy of the BGP announcer: health reading -> wanted route state (with rise/fall) -> ExaBGP commands.

A carrier's route is in one of three states: ANNOUNCED (plain), DEGRADED (announced with the AS path
prepended and the de-preferring communities: traffic engineering that keeps the prefix reachable but less
attractive) and WITHDRAWN. The gateway's health maps onto them: UP -> ANNOUNCED, DEGRADED -> DEGRADED,
DRAINING or DOWN (or no usable answer) -> WITHDRAWN. DRAINING is operator intent and applies at the next
reading; any other move needs ``fall`` consecutive readings when it is worse and ``rise`` when it is
better, so a flapping carrier does not flap its route.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from gateway.config import CarrierBgpConfig


class Reading(Enum):
    """One health reading of the carrier (``/health/carriers/<name>``)."""

    UP = "UP"
    DEGRADED = "DEGRADED"
    DRAINING = "DRAINING"
    DOWN = "DOWN"  # also: unreachable, timeout, unknown carrier, an answer that makes no sense


class Route(Enum):
    ANNOUNCED = 0
    DEGRADED = 1
    WITHDRAWN = 2


WANTED = {
    Reading.UP: Route.ANNOUNCED,
    Reading.DEGRADED: Route.DEGRADED,
    Reading.DRAINING: Route.WITHDRAWN,
    Reading.DOWN: Route.WITHDRAWN,
}


def classify(status: int | None, body: str) -> Reading:
    """A health answer as a reading: 200 ``STATUS:UP`` / ``STATUS:DEGRADED``, 503 ``STATUS:DRAINING``;
    anything else (other codes, other bodies, ``None`` for no answer) is DOWN."""
    word = body.split(maxsplit=1)[0] if body.strip() else ""
    if status == 200 and word == "STATUS:UP":
        return Reading.UP
    if status == 200 and word == "STATUS:DEGRADED":
        return Reading.DEGRADED
    if status == 503 and word == "STATUS:DRAINING":
        return Reading.DRAINING
    return Reading.DOWN


@dataclass
class Hysteresis:
    """The route state and the run of readings that would change it.

    Readings count towards a move while they keep pointing the same way (all worse than the current state,
    or all better); the move goes to what the latest reading wants.
    """

    rise: int
    fall: int
    state: Route = Route.WITHDRAWN  # nothing is announced until the carrier has been healthy ``rise`` times
    _direction: int = 0  # +1: a run of worse readings, -1: of better ones, 0: none
    _count: int = 0

    def observe(self, reading: Reading) -> Route | None:
        """Feed one reading; the new state when it changes, else None."""
        wanted = WANTED[reading]
        if wanted == self.state:
            self._direction, self._count = 0, 0
            return None
        if reading is Reading.DRAINING:
            return self._move(wanted)
        direction = 1 if wanted.value > self.state.value else -1
        self._count = self._count + 1 if direction == self._direction else 1
        self._direction = direction
        needed = self.fall if direction > 0 else self.rise
        return self._move(wanted) if self._count >= needed else None

    def _move(self, to: Route) -> Route:
        self.state, self._direction, self._count = to, 0, 0
        return to


def commands(bgp: CarrierBgpConfig, route: Route) -> list[str]:
    """The ExaBGP API commands that put the carrier's prefixes into ``route`` state, one per prefix."""
    scope = f"neighbor {bgp.neighbor}"
    lines = []
    for prefix in bgp.prefixes:
        if route is Route.WITHDRAWN:
            lines.append(f"{scope} withdraw route {prefix} next-hop {bgp.next_hop}")
            continue
        line = f"{scope} announce route {prefix} next-hop {bgp.next_hop}"
        communities = list(bgp.communities)
        if route is Route.DEGRADED:
            if bgp.degraded_prepend:
                line += f" as-path [ {' '.join([str(bgp.local_as)] * (bgp.degraded_prepend + 1))} ]"
            communities += bgp.degraded_communities
        if communities:
            line += f" community [ {' '.join(communities)} ]"
        lines.append(line)
    return lines
