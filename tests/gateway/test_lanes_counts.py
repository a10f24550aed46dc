"""A pool's shared counts (gateway/dispatch/lanes.py ``Counts``) through any sequence of the lanes' work:
adds, takes, batches (costly or not), small and large takes, drops of an agent's newest, drains, over model
queues that share one ``Counts``; and fair queueing's property that an agent served less ranks first."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from gateway.dispatch import lanes
from gateway.dispatch.lanes import Counts, ModelQueue
from gateway.dispatch.work import WorkItem
from routing.types import Decision, Priority, Reason, Tier

DECISION = Decision(Tier.EDGE_SERVER, "cpu", Reason.COMPLEXITY, 0.4)
AGENTS = ("a", "b", "c", "d")
_ids = itertools.count()


def slice_of(agent: str, n: int, at: float, *, small: bool = False, urgent: bool = False) -> list[WorkItem]:
    out = []
    for _ in range(n):
        request = pb.InferRequest(request_id=f"{agent}-{next(_ids)}".encode(), model_name="rank-mlp")
        item = WorkItem(request, agent, "us-west", "hgc", Priority.INTERACTIVE, 0.0, None, DECISION)
        item.enqueued, item.small, item.urgent = at, small, urgent
        out.append(item)
    return out


def walked(queues: list[ModelQueue]) -> tuple[dict[str, int], list[int], set[bytes]]:
    """Each agent's requests queued, each class's, and every queued id, by walking the lanes (checking
    each lane's own counts and each agent's order on the way)."""
    held: dict[str, int] = {}
    by_class = [0, 0, 0]
    ids: set[bytes] = set()
    for queue in queues:
        for index, lane in enumerate(queue.lanes):
            count = urgent = small = 0
            for agent, slices in lane._by_agent.items():
                assert slices and all(slices)
                times = [item.enqueued for part in slices for item in part]
                assert times == sorted(times)
                for part in slices:
                    ids.update(item.request.request_id for item in part)
                    count += len(part)
                    urgent += len(part) if part[0].urgent else 0
                    small += len(part) if part[0].small else 0
                    held[agent] = held.get(agent, 0) + len(part)
            assert (lane.count, lane.urgent, lane.small) == (count, urgent, small)
            by_class[index] += count
    return held, by_class, ids


Op = tuple[str, int, int, int, int, bool]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "add", "take", "batch", "small", "large", "drop", "drain", "at_once"]),
        st.integers(0, 2),  # queue
        st.integers(0, 2),  # lane
        st.integers(0, len(AGENTS) - 1),  # agent
        st.integers(0, 40),  # n
        st.booleans(),  # small (add) / costly (batch)
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, max_gone=st.sampled_from([1, 2, lanes.MAX_GONE]))
def test_the_shared_counts_follow_the_lanes_through_any_operations(ops: list[Op], max_gone: int) -> None:
    """held and by_class equal the lanes'; ``served`` holds exactly the agents with requests queued, never
    one in ``gone`` too, and an agent's count never goes back while it stays queued (also where some of its
    requests were served at once, PoolDispatcher.serve_at_once, beside others it has queued); ``gone``
    stays within its bound; every request added comes out of the lanes once, or is still queued."""
    original = lanes.MAX_GONE
    lanes.MAX_GONE = max_gone
    try:
        counts = Counts()
        queues = [ModelQueue(counts) for _ in range(3)]
        added: set[bytes] = set()
        out_ids: list[bytes] = []
        before: dict[str, int] = {}
        for step, (op, q, lane_index, agent_index, n, flag) in enumerate(ops):
            queue, lane, agent = queues[q], queues[q].lanes[lane_index], AGENTS[agent_index]
            out: list[WorkItem] = []
            if op == "add":
                items = slice_of(agent, max(n, 1), float(step), small=flag and n <= 8, urgent=n % 3 == 0)
                added.update(item.request.request_id for item in items)
                queue.add(lane_index, items)
            elif op == "take":
                out = queue.take(n)
            elif op == "batch":
                out = queue.take_batch(max(n, 1), 8, costly=flag)
                assert out or not len(queue)
            elif op == "small":
                lane.take_small(n, out)
                assert all(item.small for item in out)
            elif op == "large":
                lane.take_large(n, out)
                assert not any(item.small for item in out)
            elif op == "drop":
                out = lane.drop_newest(agent, n)
            elif op == "at_once":  # served without being queued, whether the agent has others queued or not
                counts.served_at_once(agent, max(n, 1))
            else:
                for each in queues:
                    out += each.take(len(each))
            out_ids += [item.request.request_id for item in out]
            held, by_class, queued = walked(queues)
            assert (counts.held, counts.by_class) == (held, by_class)
            assert set(counts.served) == set(held) and not set(counts.served) & set(counts.gone)
            assert len(counts.gone) <= max_gone
            assert all(counts.served[a] >= was for a, was in before.items() if a in counts.served)
            before = dict(counts.served)
            assert len(out_ids) == len(set(out_ids)) and set(out_ids) | queued == added
            assert not set(out_ids) & queued
            assert all((each.rank() is None) == (len(each) == 0) for each in queues)
    finally:
        lanes.MAX_GONE = original


@settings(max_examples=100, deadline=None)
@given(steps=st.integers(20, 120), spread=st.booleans(), batch=st.sampled_from([8, 32, 128]))
def test_an_agent_that_sends_little_is_served_first_beside_one_that_sends_much(
    steps: int, spread: bool, batch: int
) -> None:
    """heavy keeps hundreds queued in two queues; light brings one small request a step, into one of three
    queues (``spread``) or a queue of its own; each step the batcher cuts the queue that ranks first. Once
    light has been served, whenever it is served less than heavy a queue holding its request ranks first,
    and its requests never wait more than a step."""
    counts = Counts()
    queues = [ModelQueue(counts) for _ in range(3)]
    for q in (0, 1):
        queues[q].add(1, slice_of("heavy", 500, 0.0))
    for step in range(steps):
        target = queues[step % 3] if spread else queues[2]
        target.add(1, slice_of("light", 1, float(step + 1), small=True))
        for q in (0, 1):
            if len(queues[q]) < 300:
                queues[q].add(1, slice_of("heavy", 200, float(step + 1)))
        ranked = sorted((rank, i) for i, queue in enumerate(queues) if (rank := queue.rank()) is not None)
        first = queues[ranked[0][1]]
        light_waiting = [queue for queue in queues if "light" in queue.lanes[1]._by_agent]
        if "light" in counts.served and counts.served["light"] < counts.served["heavy"]:
            assert first in light_waiting
        first.take_batch(batch, 8, costly=True)
        assert counts.held.get("light", 0) <= 1
