"""Who gets a pool's queue when it is full: every agent up to its fair share, taken from agents over theirs.

A pool's queue is bounded (``max_queue_depth``). First come first served, the agent that fills every pool
able to serve a model holds all of them, and every other agent's requests for that model are refused
OVERLOADED until its flood drains, though the lanes (gateway/dispatch/lanes.py) would serve them in the
next batch. Here such requests (Ingest._route routes them once more, as only they would be refused) are
admitted past a full queue up to their agent's fair share (the queue's bound over the agents holding
requests in it, itself included), by pushing out the newest requests of the agents holding the most, none
below its own share ("longest queue drop", as switch buffers share memory between ports). Those are
answered OVERLOADED with the gateway's retry-after: the agent resends them later and its send window
halves (edge_agent/uplink/pacing.py), so a flooding agent settles at its share. An agent alone, or at or
over its share, is admitted only into free room, as before.

A more urgent request also takes the place of less urgent ones, whoever holds them: the lanes serve a
pool's realtime requests before its interactive ones and those before its batch ones, so a queue full of
batch requests is served after anything more urgent anyway, and refusing a realtime request for room they
hold inverts the priorities. An agent's own batch flood (one agent carries its whole region's traffic,
page renders and prefetch alike) refused that agent's realtime requests whatever the fair share said, as
it was always at its share. Such a request is admitted where the queue's free room and the requests of
the less urgent lanes make room for it (:func:`preempt`: the least urgent lane first, in it the agents
holding the most first, each one's newest first); those leave answered OVERLOADED with the retry-after,
as above. Where they do not make the room, the fair share decides, as above.

Pure: the agents' queued counts in, numbers out; the pool applies them (gateway/dispatch/pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence


def fair_share(held: Mapping[str, int], agent: str, capacity: int) -> int:
    """The queue's bound over the agents holding requests in it, ``agent`` counted whether or not it does."""
    return capacity // (len(held) + (agent not in held))


def room(
    held: Mapping[str, int],
    agent: str,
    depth: int,
    capacity: int,
    movable: Callable[[], Mapping[str, int]] | None = None,
) -> int:
    """How many of ``agent``'s requests the queue admits now: its free room, or more where other agents
    hold more than their fair share (up to ``agent``'s own share, pushing theirs out). ``movable``: each
    agent's requests that may be pushed out for these (:func:`push_out`'s), asked for only when a share
    counts; without it, all of them."""
    free = capacity - depth
    if 2 * free >= capacity or not held:  # free room of half the queue or more: no share is smaller
        return free
    share = fair_share(held, agent, capacity)
    mine = held.get(agent, 0)
    if mine >= share:
        return free
    limits = None if movable is None else movable()
    spare = 0
    for other, count in held.items():
        if count > share and other != agent:
            spare += count - share if limits is None else min(count - share, limits.get(other, 0))
    return max(free, min(share - mine, free + spare))


def push_out(
    held: Mapping[str, int],
    agent: str,
    need: int,
    capacity: int,
    movable: Mapping[str, int] | None = None,
) -> list[tuple[str, int]] | None:
    """Whose newest requests leave, and how many each, to make room for ``need`` more of ``agent``'s
    (which :func:`room` admits): the agents holding the most first, each cut down towards the next, none
    below its fair share; of each, at most its ``movable`` requests (those no more urgent than the
    newcomer's: a batch request never pushes out a realtime one). None when those do not make the room."""
    share = fair_share(held, agent, capacity)
    counts = {other: count for other, count in held.items() if other != agent and count > share}
    if movable is not None:
        limits = {other: min(count - share, movable.get(other, 0)) for other, count in counts.items()}
        if sum(limits.values()) < need:
            return None
        counts = {other: share + limit for other, limit in limits.items() if limit > 0}
    out, left = _level(counts, need, share)
    if left > 0:
        raise ValueError(f"no room for {need} more of agent {agent}'s requests: room() did not admit them")
    return out


def preempt(lower: Sequence[Mapping[str, int]], need: int) -> list[tuple[int, str, int]] | None:
    """Whose requests of the lanes less urgent than a newcomer's leave, to make room for ``need`` more of
    its requests: ``lower`` holds each such lane's requests per agent, the least urgent lane first. That
    lane first; within a lane the agents holding the most first, each cut down towards the next (as
    :func:`push_out`), whatever their share. Each as (index into ``lower``, agent, how many); None when
    they do not make the room (nothing is to leave then)."""
    if sum(sum(counts.values()) for counts in lower) < need:
        return None
    out: list[tuple[int, str, int]] = []
    for index, counts in enumerate(lower):
        if need <= 0:
            break
        taken, need = _level({agent: n for agent, n in counts.items() if n > 0}, need, 0)
        out.extend((index, agent, n) for agent, n in taken)
    return out


def _level(counts: dict[str, int], need: int, floor: int) -> tuple[list[tuple[str, int]], int]:
    """Up to ``need`` taken from ``counts`` (agents holding more than ``floor``), the one holding the most
    first, cut down towards the next, then both in turn; none below ``floor``. What each gives, and how
    many of ``need`` are left (``counts`` is used up)."""
    out: dict[str, int] = {}
    while need > 0 and counts:
        ranked = sorted(counts.items(), key=lambda entry: -entry[1])
        top, most = ranked[0]
        below = max(floor, ranked[1][1] if len(ranked) > 1 else floor)
        take = min(need, max(1, most - below))  # down to the next one, then both in turn
        out[top] = out.get(top, 0) + take
        need -= take
        if most - take > floor:
            counts[top] = most - take
        else:
            del counts[top]
    return list(out.items()), need
