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
requests when the pool pushes them out for another agent's. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque

from gateway.dispatch.work import WorkItem


class Lane:
    """One priority class's requests in one model's queue, by agent (see the module's docstring)."""

    __slots__ = ("_by_agent", "_by_class", "_class", "_held", "count", "small", "urgent")

    def __init__(
        self, held: dict[str, int] | None = None, by_class: list[int] | None = None, index: int = 0
    ) -> None:
        # Each agent's slices, oldest first; the dict's order is the agents' turn order.
        self._by_agent: dict[str, deque[list[WorkItem]]] = {}
        self._held = {} if held is None else held  # requests queued per agent, over the pool's lanes
        # requests queued per class over the pool's queues (``index``: this lane's), as ``held`` per agent
        self._by_class = [0, 0, 0] if by_class is None else by_class
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
        held[agent] = held.get(agent, 0) + n
        if items[0].urgent:
            self.urgent += n
        if items[0].small:
            self.small += n

    def head(self) -> WorkItem | None:
        """The request queued first of those at the front of each agent's line (None: the lane is empty)."""
        by_agent = self._by_agent
        if len(by_agent) == 1:  # mostly
            for slices in by_agent.values():
                return slices[0][0]
        oldest: WorkItem | None = None
        for slices in by_agent.values():
            first = slices[0][0]
            if oldest is None or first.enqueued < oldest.enqueued:
                oldest = first
        return oldest

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


class ModelQueue:
    """The three lanes of one (model, version, size group), realtime first: a batch takes a lane's requests
    only once the lanes before it are empty."""

    __slots__ = ("lanes", "small_last")

    def __init__(self, held: dict[str, int] | None = None, by_class: list[int] | None = None) -> None:
        """``held`` and ``by_class``: the pool's counts per agent and per class, kept by its lanes."""
        held = {} if held is None else held
        by_class = [0, 0, 0] if by_class is None else by_class
        self.lanes: tuple[Lane, Lane, Lane] = (
            Lane(held, by_class, 0),
            Lane(held, by_class, 1),
            Lane(held, by_class, 2),
        )
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

    def head(self) -> WorkItem | None:
        """The oldest request of the most urgent lane that has any."""
        for lane in self.lanes:
            if lane.count:
                if len(lane._by_agent) == 1:  # mostly: its one agent's oldest
                    for slices in lane._by_agent.values():
                        return slices[0][0]
                return lane.head()
        return None

    def oldest_enqueued(self) -> float:
        """When the oldest request queued was queued (the queue is not empty)."""
        oldest = math.inf
        for lane in self.lanes:
            if lane.count:
                for slices in lane._by_agent.values():
                    oldest = min(oldest, slices[0][0].enqueued)
        return oldest

    def take_batch(self, size: int, inline: int) -> list[WorkItem]:
        """The next batch of up to ``size``. Where that is more than the CPU stage runs in the gateway's own
        process (``inline``) and the most urgent lane holding requests holds small frames' beside others
        (larger frames' in it or any in a less urgent lane), the lane's small and larger frames take turns:
        a batch of the small frames' alone (:meth:`Lane.take_small`, at most ``inline``: run inline), then
        one of its larger frames' alone (:meth:`Lane.take_large`), so neither rides the other's batches and
        a stream of small frames cannot hold larger ones back. Else :meth:`take`."""
        lane = None if size <= inline else next((lane for lane in self.lanes if lane.count), None)
        if lane is not None and lane.small and len(self) > lane.small:
            # Small frames' requests lead the batch and others would fill it (larger frames' in this lane,
            # or any in a less urgent one, which wait for this lane as always).
            small, large = (lane.take_small, inline), (lane.take_large, size)
            for take, most in (large, small) if self.small_last else (small, large):
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
