"""A pool's lanes: the agents with requests queued in a priority class share each batch; each agent's
requests keep their order; a more urgent lane still goes first."""

from __future__ import annotations

from edgewire import pb
from gateway.dispatch.lanes import Counts, Lane, ModelQueue
from gateway.dispatch.work import WorkItem
from routing.types import Decision, Priority, Reason, Tier

DECISION = Decision(Tier.EDGE_SERVER, "cpu", Reason.COMPLEXITY, 0.4)


def frame(agent: str, n: int, enqueued: float, tag: str = "") -> list[WorkItem]:
    """A slice of ``n`` requests of one of ``agent``'s frames, queued at ``enqueued``."""
    out = []
    for i in range(n):
        request = pb.InferRequest(request_id=f"{agent}{tag}-{i}".encode(), model_name="rank-mlp")
        work = WorkItem(request, agent, "us-west", "hgc", Priority.INTERACTIVE, 0.0, None, DECISION)
        work.enqueued = enqueued
        out.append(work)
    return out


def ids(items: list[WorkItem]) -> list[str]:
    return [item.request.request_id.decode() for item in items]


def taken(lane: Lane, n: int) -> list[WorkItem]:
    out: list[WorkItem] = []
    lane.take(n, out)
    return out


def test_a_lone_request_goes_in_the_next_batch_not_behind_another_agents_queue() -> None:
    """One agent's 10 frames of 100 queued first, another agent's single request after them: the next
    batch of 32 holds it (first come first served it waited for 1,000 requests: 32 batches)."""
    lane = Lane()
    for f in range(10):
        lane.add(frame("flood", 100, enqueued=float(f), tag=f"f{f}"))
    lane.add(frame("lone", 1, enqueued=10.0))
    batch = taken(lane, 32)
    assert len(batch) == 32
    assert "lone-0" in ids(batch)
    assert [i for i in ids(batch) if i != "lone-0"] == [f"floodf0-{i}" for i in range(31)]  # oldest, in order
    assert (len(lane), lane.agents) == (1000 - 31, 1)


def test_agents_share_a_batch_equally_and_one_taking_less_leaves_the_rest() -> None:
    """Max-min: 3 agents with 100, 100 and 2 queued share a batch of 32 as 15, 15 and 2."""
    lane = Lane()
    lane.add(frame("a", 100, 0.0))
    lane.add(frame("b", 100, 1.0))
    lane.add(frame("c", 2, 2.0))
    batch = taken(lane, 32)
    by_agent = {agent: [i for i in ids(batch) if i.startswith(agent)] for agent in "abc"}
    assert {a: len(v) for a, v in by_agent.items()} == {"a": 15, "b": 15, "c": 2}
    assert by_agent["a"] == [f"a-{i}" for i in range(15)]
    assert len(lane) == 200 - 30 and lane.agents == 2


def test_each_agents_requests_keep_their_order_across_slices_and_batches() -> None:
    """Slices split across batches: every agent's requests come out in the order they were queued."""
    lane = Lane()
    for f in range(4):
        lane.add(frame("a", 7, float(f), tag=f"s{f}"))
        lane.add(frame("b", 5, float(f) + 0.5, tag=f"s{f}"))
    out: list[str] = []
    while lane:
        out += ids(taken(lane, 6))
    for agent, n in (("a", 7), ("b", 5)):
        assert [i for i in out if i.startswith(agent)] == [
            f"{agent}s{f}-{i}" for f in range(4) for i in range(n)
        ]
    assert len(out) == 48


def test_with_less_room_than_agents_the_next_batch_begins_with_those_left_out() -> None:
    """Batches of 2 from 5 agents' lines: every agent is served within three batches."""
    lane = Lane()
    for agent in "abcde":
        lane.add(frame(agent, 3, 0.0))
    first_three = [ids(taken(lane, 2)) for _ in range(3)]
    served = {i[0] for batch in first_three for i in batch}
    assert served == set("abcde"), first_three
    assert all(len(batch) == 2 for batch in first_three)


def test_a_lanes_rank_is_its_least_served_agents_count_and_its_oldest_request() -> None:
    counts = Counts()
    lane = Lane(counts)
    lane.add(frame("late", 2, 5.0))
    lane.add(frame("early", 2, 1.0))
    assert lane.rank() == (0, 1.0)  # both new: level; the oldest at the front of any agent's line
    out: list[WorkItem] = []
    lane._take_from("early", 1, out)
    assert (counts.served, lane.rank()) == ({"late": 0, "early": 1}, (0, 1.0))
    lane._take_from("late", 2, out)
    assert lane.rank() == (1, 1.0)  # early's alone now


def test_model_queue_takes_lanes_in_priority_order_then_shares_within_one() -> None:
    """Realtime first; the batch's room left goes to the interactive lane's agents, shared."""
    queue = ModelQueue()
    queue.add(1, frame("flood", 50, 0.0))
    queue.add(1, frame("lone", 1, 3.0))
    queue.add(0, frame("rt", 2, 4.0, tag="rt"))
    assert queue.realtime and len(queue) == 53
    assert queue.oldest_enqueued() == 0.0
    assert queue.rank() == (0, 0, 4.0)  # the realtime lane's
    batch = ids(queue.take(8))
    assert batch[:2] == ["rtrt-0", "rtrt-1"]
    assert "lone-0" in batch[2:] and len(batch) == 8
    assert not queue.realtime and len(queue) == 45
    rest = queue.take(len(queue))
    assert ids(rest) == [f"flood-{i}" for i in range(5, 50)] and len(queue) == 0


def test_a_lane_counts_the_requests_of_urgent_frames_it_holds() -> None:
    """``urgent`` counts the queued requests of urgent frames (WorkItem.urgent: frames marked realtime),
    slices split by a batch included, so the pool knows when a batch it cuts holds a caller waiting alone."""
    lane = Lane()
    lane.add(frame("flood", 40, enqueued=0.0))
    lone = frame("lone", 3, enqueued=1.0)
    for item in lone:
        item.urgent = True
    lane.add(lone)
    assert (lane.count, lane.urgent) == (43, 3)
    first = taken(lane, 4)  # two each: the flood's 2 oldest, 2 of the lone agent's 3 (a slice split)
    assert sorted(ids(first)) == ["flood-0", "flood-1", "lone-0", "lone-1"]
    assert (lane.count, lane.urgent) == (39, 1)
    taken(lane, 39)
    assert (lane.count, lane.urgent) == (0, 0)


def test_an_agents_newest_requests_are_dropped_from_the_tail_and_the_counts_follow() -> None:
    """drop_newest takes an agent's newest slice, then splits the one before; the lane's counts, its urgent
    count and the agents' counts shared with the pool follow, and the agent keeps its turn while it has
    requests left."""
    counts = Counts()
    held = counts.held
    lane = Lane(counts)
    lane.add(frame("a", 5, 0.0, tag="f0"))
    lane.add(frame("b", 3, 1.0))
    late = frame("a", 4, 2.0, tag="f1")
    for item in late:
        item.urgent = True
    lane.add(late)
    assert (held, lane.urgent, lane.newest("a"), lane.newest("c")) == ({"a": 9, "b": 3}, 4, 2.0, None)
    dropped = lane.drop_newest("a", 6)
    assert ids(dropped) == ["af0-3", "af0-4"] + [f"af1-{i}" for i in range(4)]  # in the order queued
    assert (len(lane), lane.urgent, held) == (6, 0, {"a": 3, "b": 3})
    assert ids(taken(lane, 4)) == ["af0-0", "af0-1", "b-0", "b-1"]  # a kept its turn
    assert held == {"a": 1, "b": 1}
    assert ids(lane.drop_newest("a", 5)) == ["af0-2"]  # all it has left
    assert (held, lane.agents, len(lane)) == ({"b": 1}, 1, 1)


def test_the_queues_of_a_pool_count_its_requests_per_class_together() -> None:
    """Two model queues sharing one count per class (the pool's: PoolSignals.urgent_depth reads it):
    adds, takes and drops keep it equal to the lanes' own counts."""
    counts = Counts()
    by_class = counts.by_class
    first, second = ModelQueue(counts), ModelQueue(counts)
    first.add(0, frame("a", 2, 0.0))
    first.add(2, frame("a", 5, 0.0, tag="b"))
    second.add(1, frame("b", 3, 1.0))
    second.add(0, frame("b", 1, 1.0, tag="r"))
    assert by_class == [3, 3, 5]
    assert ids(first.take(4)) == ["a-0", "a-1", "ab-0", "ab-1"]
    assert second.lanes[1].drop_newest("b", 2) and by_class == [1, 1, 3]
    assert by_class == [sum(q.lanes[i].count for q in (first, second)) for i in range(3)]


def small(items: list[WorkItem]) -> list[WorkItem]:
    for item in items:
        item.small = True
    return items


def test_small_frames_requests_are_taken_apart_from_a_floods() -> None:
    """take_small moves the requests of small frames that lead their agents' lines, up to the limit, the
    agents in turn; take_large those of larger frames."""
    lane = Lane()
    lane.add(frame("flood", 100, 0.0))
    lane.add(small(frame("b", 2, 1.0)))
    lane.add(small(frame("c", 1, 2.0)))
    lane.add(frame("c", 50, 3.0, tag="big"))  # c's frame of 50 behind its small one: it waits its turn
    out: list[WorkItem] = []
    lane.take_small(32, out)
    assert ids(out) == ["b-0", "b-1", "c-0"]
    assert (lane.small, len(lane)) == (0, 150)
    lane.take_small(32, out)
    assert len(out) == 3  # no small frame left: nothing
    lane = Lane()
    lane.add(frame("flood", 40, 0.0))
    lane.add(small(frame("e", 40, 1.0)))  # a small frame of 40 would not happen: the limit holds
    out.clear()
    lane.take_small(32, out)
    assert (len(out), lane.small, len(lane)) == (32, 8, 48)
    out.clear()
    lane.take_large(100, out)  # the larger frames' alone, as many as there are
    assert (len(out), lane.small, len(lane)) == (40, 8, 8)


def test_small_frames_batches_take_turns_with_the_larger_frames_however_many_keep_coming() -> None:
    """take_batch: where a batch is too large to run inline, small frames' requests and larger frames'
    go in batches of their own; small frames first while their agent is served less than the flood's
    (fair queueing by requests, as between queues), else in turns. Two agents each bring 16 small
    requests before every cut (one agent's small frames, then the other's): the flood gets a whole batch
    of 128 whenever both have been served as many requests as it has (taking the small ones first every
    time, the flood got none; letting them share the flood's batch, they rode its CPU worker round trips;
    until 2026-12-07 the turns were strict, a small frames' batch then a flood's, whoever was served
    more)."""
    queue = ModelQueue()
    for f in range(4):
        queue.add(1, frame("flood", 100, 0.0, tag=f"f{f}"))
    cuts = []
    for turn in range(40):
        agent = f"s{turn % 2}"
        queue.add(1, small(frame(agent, 8, float(turn), tag=f"x{turn}")))
        queue.add(1, small(frame(agent, 8, float(turn), tag=f"y{turn}")))
        batch = queue.take_batch(128, 32)
        cuts.append((len(batch), sum(1 for item in batch if item.agent_id == "flood")))
    # first both new (level): small first, then in turns; the flood's 128 served, the small frames go
    # first until each agent has been served 128 too, and so on
    flood, smalls = [(128, 128), (32, 0)], [(16, 0)]
    assert cuts == smalls + flood + smalls * 13 + flood + smalls * 14 + flood + smalls * 6
    counts = queue.lanes[1]._counts
    assert (counts.served, counts.gone) == ({"flood": 384}, {"s0": 320, "s1": 320})
    assert queue.take_batch(16, 32) and not queue.small_last  # small enough to run inline: the usual cut


def test_small_frames_batch_apart_where_a_batch_costs_the_backend_much_even_if_it_runs_inline() -> None:
    """A batch of 16 runs inline (16 <= 32): small frames' requests ride it with the flood's, unless the
    pool says such a batch is costly (its time per request: a device whose time grows with rows), then
    they go alone."""
    for costly, first in ((False, 16), (True, 1)):
        queue = ModelQueue()
        queue.add(1, frame("flood", 100, 0.0))
        queue.add(1, small(frame("b", 1, 1.0)))
        batch = queue.take_batch(16, 32, costly=costly)
        assert len(batch) == first and ("b-0" in ids(batch)) is True


def test_small_frames_batch_alone_when_only_a_less_urgent_lane_holds_a_flood() -> None:
    """A lone interactive request and a flood of batch requests: its batch is its own (the batch lane
    waits for the interactive one, as always), not filled to 128 with the flood's; alone in the queue,
    small frames' requests are batched as usual."""
    queue = ModelQueue()
    queue.add(2, frame("flood", 300, 0.0))
    queue.add(1, small(frame("b", 1, 1.0)))
    assert ids(queue.take_batch(128, 32)) == ["b-0"]
    assert len(queue.take_batch(128, 32)) == 128  # then the flood's
    alone = ModelQueue()
    alone.add(1, small(frame("c", 4, 0.0)))
    alone.add(1, small(frame("d", 4, 0.0)))
    assert len(alone.take_batch(128, 32)) == 8 and not alone.small_last


def test_an_agent_that_comes_starts_where_the_last_batch_began() -> None:
    """Fair queueing's tags (Counts.served, in requests): a served 64 in two batches; b comes with 3
    requests and starts at 32, where a's last batch began (not at 0: ahead of a by all a was served; not
    at 64: level with a, its requests older), so b's queue ranks first; served, b leaves the counts. c
    comes with 100 and starts at 32 too: one batch of c's, then a's queue ranks first again (level, older)."""
    counts = Counts()
    x, y = ModelQueue(counts), ModelQueue(counts)
    x.add(1, frame("a", 128, 0.0))
    assert ids(x.take(32)) == [f"a-{i}" for i in range(32)] and len(x.take(32)) == 32
    y.add(1, frame("b", 3, 1.0))
    assert counts.served == {"a": 64, "b": 32}
    assert y.rank() == (1, 32, 1.0) < (1, 64, 0.0) == x.rank()
    assert ids(y.take(32)) == ["b-0", "b-1", "b-2"] and counts.served == {"a": 64}
    y.add(1, frame("c", 100, 2.0))
    assert counts.served["c"] == 32 and y.rank() == (1, 32, 2.0)  # before x's (1, 64, 0.0)
    y.take(32)
    assert y.rank() == (1, 64, 2.0) > (1, 64, 0.0) == x.rank()
