"""A pool's queue for one model: three priority lanes, each shared between the agents whose requests wait
in it.

A lane holds slices of frames (a frame's requests routed alike arrive as one list), each agent's in the
order they came. A batch is cut from the lanes in priority order, realtime first; within a lane the agents
with requests waiting share it: each gets at most an equal part of what the batch has room for, taken
from its oldest slices, and an agent taking less leaves the rest to the others (max-min fair), so an
agent with thousands of requests queued delays another's by about one batch, not by all of its own; first
come first served, one agent's flood of frames of 100 held another's lone interactive requests behind
every request it had queued for that model (bench/realtime_under_load.py --lone interactive). The
agents served go to the back of the lane's order, so when a batch has less room than the lane has agents,
the next batch begins with the ones left out. Where a batch would be too large for the CPU stage to run
in the gateway's process, small frames' requests (a lone request, a caller's few) and larger frames' take
turns in batches of their own (ModelQueue.take_batch), so a lone request does not ride a flood's batch
through a worker. A lane also counts each agent's requests in a dict shared by the pool's queues
(``held``: gateway/dispatch/admission.py shares a full queue by it), and gives up an agent's newest
requests when the pool pushes them out for another agent's. Between a pool's queues the agents are
shared too (:class:`Counts`, fair queueing by requests served): a queue ranks by its most urgent lane, then
by the least served of the agents there, then by age, so an agent that sends little goes before one that
sends much, whatever queues (models, text length buckets) their requests are spread over. Pure: no clock,
no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from gateway.dispatch.work import WorkItem

MAX_GONE = 4096
"""Agents with no request queued whose requests served a pool remembers (Counts.gone)."""

Rank = tuple[int, int, float]
"""How a queue ranks for the pool's next batch, least first: its most urgent lane holding requests (0:
realtime), the least served of the agents there (:attr:`Counts.served`), its oldest request's queueing
time."""


class Counts:
    """What the lanes of one pool's queues count together: requests queued per agent (``held``: admission
    shares a full queue by it) and per class (``by_class``, realtime first: routing's urgent depth), and
    each agent's requests served (``served``: taken into batches), kept while it has requests queued.

    ``served`` is start-time fair queueing's tags, counted in requests: the batcher's next batch goes to
    the queue of the least served agent, so one that sends little goes before one that sends much, and a
    flood's agent, whose count stands still while it waits, is served once the others have caught up with
    it. An agent whose requests were all served leaves ``served`` for ``gone`` (the most recent
    ``MAX_GONE``); one that comes (back) starts where it left off or at ``virtual``, where the last batch
    began (the count of the agent it was taken from, before it), whichever is later: ahead of an agent
    served since by at most that batch, never by what it did not send while away, and a stream of small
    frames from one agent catches up with a flood and then takes turns with it."""

    __slots__ = ("by_class", "gone", "held", "served", "virtual")

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.by_class = [0, 0, 0]
        self.served: dict[str, int] = {}
        self.gone: dict[str, int] = {}  # agents with none queued now: their counts, least recent first
        self.virtual = 0

    def joined(self, agent: str) -> None:
        """``agent``, which had no request queued, has one now."""
        self.served[agent] = max(self.gone.pop(agent, 0), self.virtual)

    def left(self, agent: str) -> None:
        """``agent``'s requests queued are all gone (served, pushed out, handed back)."""
        gone = self.gone
        gone[agent] = self.served.pop(agent)
        if len(gone) > MAX_GONE:
            del gone[next(iter(gone))]

    def took(self, agent: str, n: int) -> None:
        """``n`` of ``agent``'s requests were taken into a batch."""
        served = self.served
        self.virtual = start = served[agent]
        served[agent] = start + n

    def served_at_once(self, agent: str, n: int) -> None:
        """``n`` of ``agent``'s requests were served without being queued (PoolDispatcher.serve_at_once):
        counted as a batch the pass took of them, so as if they had joined, been taken and left, or, where
        the agent has other requests queued in the pool (another model's), only taken."""
        if agent in self.served:
            self.took(agent, n)
            return
        self.joined(agent)
        self.took(agent, n)
        self.left(agent)

    def least_served(self, agents: Iterable[str]) -> int:
        """The least served of ``agents`` (each has requests queued)."""
        served = self.served
        return min(served[agent] for agent in agents)


class Lane:
    """One priority class's requests in one model's queue, by agent (see the module's docstring)."""

    __slots__ = ("_by_agent", "_by_class", "_class", "_counts", "_held", "count", "small", "urgent")

    def __init__(self, counts: Counts | None = None, index: int = 0) -> None:
        # Each agent's slices, oldest first; the dict's order is the agents' turn order.
        self._by_agent: dict[str, deque[list[WorkItem]]] = {}
        # What the pool's lanes count together (``index``: this lane's class)
        self._counts = counts = Counts() if counts is None else counts
        self._held = counts.held
        self._by_class = counts.by_class
        self._class = index
        self.count = 0
        self.urgent = 0  # of them, urgent frames' (WorkItem.urgent; a slice is one frame's: all or none)
        self.small = 0  # of them, small frames' (WorkItem.small)

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def agents(self) -> int:
        """How many agents have requests waiting in the lane."""
        return len(self._by_agent)

    def add(self, items: list[WorkItem]) -> None:
        """Queue a slice of one agent's frame (not empty), after that agent's earlier ones."""
        agent = items[0].agent_id
        slices = self._by_agent.get(agent)
        if slices is None:
            self._by_agent[agent] = deque((items,))
        else:
            slices.append(items)
        n = len(items)
        self.count += n
        self._by_class[self._class] += n
        held = self._held
        before = held.get(agent, 0)
        held[agent] = before + n
        if not before:
            self._counts.joined(agent)
        if items[0].urgent:
            self.urgent += n
        if items[0].small:
            self.small += n

    def rank(self) -> tuple[int, float]:
        """The least served of the agents here (:attr:`Counts.served`) and when the oldest request here was
        queued (the lane is not empty)."""
        by_agent = self._by_agent
        if len(by_agent) == 1:  # mostly
            for agent, slices in by_agent.items():
                return self._counts.served[agent], slices[0][0].enqueued
        oldest = min(slices[0][0].enqueued for slices in by_agent.values())
        return self._counts.least_served(by_agent), oldest

    def take(self, n: int, out: list[WorkItem]) -> None:
        """Move up to ``n`` requests into ``out``: the agents in turn, each at most an equal share of the
        room left (at least one), each one's oldest first; those served go to the back of the turn order."""
        by_agent = self._by_agent
        if len(by_agent) == 1:  # mostly: one agent's requests, no sharing to work out
            for agent in by_agent:
                self._take_from(agent, n, out)
                return  # before the loop goes on: _take_from changed the dict
        while n > 0 and by_agent:
            share = max(1, n // len(by_agent))
            for agent in list(by_agent):
                if n <= 0:
                    break
                n -= self._take_from(agent, min(share, n), out)

    def small_first(self) -> bool:
        """Whether an agent whose line a small frame's requests lead is served less than every agent whose
        line larger frames' lead (:attr:`Counts.served`)."""
        served = self._counts.served
        small = large = math.inf
        for agent, slices in self._by_agent.items():
            if slices[0][0].small:
                small = min(small, served[agent])
            else:
                large = min(large, served[agent])
        return small < large

    def take_small(self, limit: int, out: list[WorkItem]) -> None:
        """Move into ``out`` up to ``limit`` requests of small frames (WorkItem.small), the agents in turn,
        each one's that lead its line (its order kept)."""
        if not self.small:
            return
        for agent, slices in list(self._by_agent.items()):
            if limit <= 0:
                break
            leading = 0
            for part in slices:
                if not part[0].small or leading >= limit:
                    break
                leading += len(part)
            if leading:
                limit -= self._take_from(agent, min(leading, limit), out)

    def take_large(self, n: int, out: list[WorkItem]) -> None:
        """:meth:`take` of the requests of larger frames only (not WorkItem.small): the agents whose lines
        they lead share ``n`` max-min, each up to its next small frame's (its order kept)."""
        by_agent = self._by_agent
        leading = [agent for agent, slices in by_agent.items() if not slices[0][0].small]
        while n > 0 and leading:
            share = max(1, n // len(leading))
            more = []
            for agent in leading:
                if n <= 0:
                    break
                want = min(share, n)
                got = self._take_from(agent, want, out, large_only=True)
                n -= got
                slices = by_agent.get(agent)
                if got == want and slices and not slices[0][0].small:
                    more.append(agent)
            leading = more

    def _take_from(self, agent: str, n: int, out: list[WorkItem], *, large_only: bool = False) -> int:
        """Move up to ``n`` of ``agent``'s oldest requests into ``out`` (splitting a slice if need be; with
        ``large_only``, none from its first small frame's slice on) and put the agent at the back of the
        turn order, or out of it when none are left; how many moved."""
        slices = self._by_agent.pop(agent)
        taken = urgent = small = 0
        while slices and taken < n:
            first = slices[0]
            if large_only and first[0].small:
                break
            room = n - taken
            if len(first) <= room:
                out.extend(slices.popleft())
                moved = len(first)
            else:
                out.extend(first[:room])
                slices[0] = first[room:]
                moved = room
            taken += moved
            if first[0].urgent:
                urgent += moved
            if first[0].small:
                small += moved
        if slices:
            self._by_agent[agent] = slices
        if taken:
            self._counts.took(agent, taken)
        self._moved(agent, taken, urgent, small)
        return taken

    def queued_by_agent(self) -> list[tuple[str, int]]:
        """Each agent's requests queued in the lane (a walk over its slices: for the rare full queue)."""
        return [(agent, sum(len(part) for part in slices)) for agent, slices in self._by_agent.items()]

    def newest(self, agent: str) -> float | None:
        """When ``agent``'s newest slice in the lane was queued (None: it has none here)."""
        slices = self._by_agent.get(agent)
        return None if slices is None else slices[-1][0].enqueued

    def drop_newest(self, agent: str, n: int) -> list[WorkItem]:
        """Remove up to ``n`` of ``agent``'s newest requests (splitting a slice if need be), keeping its
        place in the turn order while any are left; the removed ones, in the order they were queued."""
        slices = self._by_agent.get(agent)
        dropped: list[list[WorkItem]] = []
        removed = urgent = small = 0
        while slices and removed < n:
            last = slices[-1]
            room = n - removed
            if len(last) <= room:
                part = slices.pop()
            else:
                part = last[len(last) - room :]
                slices[-1] = last[: len(last) - room]
            dropped.append(part)
            removed += len(part)
            if part[0].urgent:
                urgent += len(part)
            if part[0].small:
                small += len(part)
        if slices is not None and not slices:
            del self._by_agent[agent]
        self._moved(agent, removed, urgent, small)
        return [item for part in reversed(dropped) for item in part]

    def _moved(self, agent: str, n: int, urgent: int, small: int) -> None:
        """``n`` of ``agent``'s requests left the lane, ``urgent`` of them urgent, ``small`` small frames'."""
        if not n:
            return
        self.count -= n
        self._by_class[self._class] -= n
        self.urgent -= urgent
        self.small -= small
        held = self._held
        left = held.get(agent, 0) - n
        if left > 0:
            held[agent] = left
        else:
            held.pop(agent, None)
            self._counts.left(agent)


class ModelQueue:
    """The three lanes of one (model, version, size group), realtime first: a batch takes a lane's requests
    only once the lanes before it are empty."""

    __slots__ = ("lanes", "small_last")

    def __init__(self, counts: Counts | None = None) -> None:
        """``counts``: what the pool's lanes count together."""
        counts = Counts() if counts is None else counts
        self.lanes: tuple[Lane, Lane, Lane] = (Lane(counts, 0), Lane(counts, 1), Lane(counts, 2))
        self.small_last = False  # the last batch was small frames' alone: larger frames' turn (take_batch)

    def __len__(self) -> int:
        lanes = self.lanes
        return lanes[0].count + lanes[1].count + lanes[2].count

    @property
    def realtime(self) -> bool:
        """Whether a realtime request is queued."""
        return self.lanes[0].count > 0

    def add(self, lane: int, items: list[WorkItem]) -> None:
        self.lanes[lane].add(items)

    def rank(self) -> Rank | None:
        """How the queue ranks for the pool's next batch (:data:`Rank`); None: it is empty."""
        for index, lane in enumerate(self.lanes):
            if lane.count:
                return (index, *lane.rank())
        return None

    def oldest_enqueued(self) -> float:
        """When the oldest request queued was queued (the queue is not empty)."""
        oldest = math.inf
        for lane in self.lanes:
            if lane.count:
                for slices in lane._by_agent.values():
                    oldest = min(oldest, slices[0][0].enqueued)
        return oldest

    def take_batch(self, size: int, inline: int, *, costly: bool = False) -> list[WorkItem]:
        """The next batch of up to ``size``. Where that is more than the CPU stage runs in the gateway's own
        process (``inline``), or ``costly`` (such a batch costs the backend much more than one of a few
        requests: the pool's time grows with its rows), and the most urgent lane holding requests holds
        small frames' beside others (larger frames' in it or any in a less urgent lane), the lane's small and
        larger frames take turns: a batch of the small frames' alone (:meth:`Lane.take_small`, at most
        ``inline``: run inline), then one of its larger frames' alone (:meth:`Lane.take_large`), so neither
        rides the other's batches and a stream of small frames cannot hold larger ones back; except that
        small frames go first whenever an agent they lead is served less than every agent whose larger
        frames lead (:meth:`Lane.small_first`: fair queueing, as between queues). Else :meth:`take`."""
        apart = size > inline or costly
        lane = next((lane for lane in self.lanes if lane.count), None) if apart else None
        if lane is not None and lane.small and len(self) > lane.small:
            # Small frames' requests lead the batch and others would fill it (larger frames' in this lane,
            # or any in a less urgent one, which wait for this lane as always).
            small, large = (lane.take_small, min(inline, size)), (lane.take_large, size)
            large_first = self.small_last and not lane.small_first()
            for take, most in (large, small) if large_first else (small, large):
                out: list[WorkItem] = []
                take(most, out)
                if out:
                    self.small_last = out[0].small
                    return out
        self.small_last = False
        return self.take(size)

    def take(self, n: int) -> list[WorkItem]:
        """Up to ``n`` requests, lane by lane, most urgent first."""
        out: list[WorkItem] = []
        for lane in self.lanes:
            if len(out) >= n:
                break
            if lane.count:
                lane.take(n - len(out), out)
        return out
