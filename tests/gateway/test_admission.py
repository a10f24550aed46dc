"""Sharing a full pool queue between agents (gateway/dispatch/admission.py): an agent under its fair share
is admitted by pushing out the newest requests of the agents over theirs, the heaviest first; a more
urgent request takes the place of less urgent ones, the least urgent lane first."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.dispatch.admission import fair_share, preempt, push_out, room


def test_an_agent_alone_gets_only_the_free_room() -> None:
    assert room({"a": 60}, "a", 60, 64) == 4
    assert room({}, "a", 0, 64) == 64


def test_another_agent_is_admitted_up_to_its_share_of_a_full_queue() -> None:
    """64 held by one agent: a second one may have 32 of them."""
    assert fair_share({"a": 64}, "b", 64) == 32
    assert room({"a": 64}, "b", 64, 64) == 32
    assert push_out({"a": 64}, "b", 10, 64) == [("a", 10)]


def test_an_agent_at_its_share_gets_only_the_free_room() -> None:
    assert room({"a": 30, "b": 32}, "b", 62, 64) == 2  # b's share is 32: the 2 free, nothing pushed
    assert room({"a": 40, "b": 22}, "b", 62, 64) == 10  # under it: up to 32, 8 of them a's


def test_no_one_is_cut_below_its_share() -> None:
    """Three agents: shares of 21. b holds 20, c nothing: c may have 21, all from a's 44 over its share."""
    held = {"a": 44, "b": 20}
    assert room(held, "c", 64, 64) == 21
    assert push_out(held, "c", 21, 64) == [("a", 21)]
    assert room({"a": 30, "b": 30}, "c", 60, 64) == 21  # 4 free and 18 over shares: c's own share caps it


def test_the_heaviest_gives_first_then_both_in_turn() -> None:
    """a 40, b 24 over shares of 21: a first comes down to b's 24, then they give alternately."""
    taken = dict(push_out({"a": 40, "b": 24}, "c", 20, 64))
    assert taken == {"a": 18, "b": 2}
    with pytest.raises(ValueError, match="room"):
        push_out({"a": 40, "b": 24}, "c", 23, 64)  # 19 + 3 over their shares: room() says 21


@given(
    st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 80), max_size=5),
    st.sampled_from("abcdef"),
    st.integers(1, 200),
)
def test_what_room_admits_push_out_frees_within_every_share(
    held: dict[str, int], agent: str, cap: int
) -> None:
    depth = sum(held.values())
    if depth > cap:
        return  # a queue never holds more than its bound
    n = room(held, agent, depth, cap)
    free = cap - depth
    assert n >= free
    if n == free:
        return
    share = fair_share(held, agent, cap)
    assert held.get(agent, 0) + n <= share  # pushing out never takes an agent past its own share
    taken = dict(push_out(held, agent, n - free, cap))
    assert sum(taken.values()) == n - free
    assert agent not in taken
    assert all(held[victim] - count >= share for victim, count in taken.items())


def test_push_out_takes_only_what_may_be_moved() -> None:
    """movable: each agent's requests no more urgent than the newcomer's. a holds 40 but only 5 of them
    may go: b's 10 cannot be made room for; with 12 movable they can, all from a."""
    assert push_out({"a": 40}, "b", 10, 40, movable={"a": 5}) is None
    assert push_out({"a": 40}, "b", 10, 40, movable={"a": 12}) == [("a", 10)]
    held = {"a": 30, "b": 10}  # shares of 13 with c: only a is over
    assert push_out(held, "c", 6, 40, movable={"a": 4, "b": 10}) is None
    assert push_out(held, "c", 6, 40, movable={"a": 17}) == [("a", 6)]


def test_preempt_empties_the_least_urgent_lane_first_its_heaviest_agent_first() -> None:
    """Lanes least urgent first: batch (a 6, b 2), then interactive (a 4). 5 go: a down to b's 2 in the
    batch lane, then both in turn; 9 go: the batch lane's 8, then one of the interactive lane's."""
    lower = [{"a": 6, "b": 2}, {"a": 4}]
    assert preempt(lower, 5) == [(0, "a", 5)]
    taken = preempt(lower, 7)
    assert taken is not None and sorted(taken) == [(0, "a", 6), (0, "b", 1)]
    assert preempt(lower, 9) == [(0, "a", 6), (0, "b", 2), (1, "a", 1)]
    assert preempt(lower, 13) is None  # they hold 12
    assert preempt([{}, {"a": 0}], 1) is None
    assert lower == [{"a": 6, "b": 2}, {"a": 4}]  # the caller's counts are left as they were


@given(
    st.lists(
        st.dictionaries(st.sampled_from("abcd"), st.integers(0, 30), max_size=4), min_size=1, max_size=2
    ),
    st.integers(1, 150),
)
def test_preempt_takes_exactly_what_is_needed_lane_by_lane(lower: list[dict[str, int]], need: int) -> None:
    plan = preempt(lower, need)
    held = sum(sum(counts.values()) for counts in lower)
    if held < need:
        assert plan is None
        return
    assert plan is not None
    assert sum(n for _, _, n in plan) == need
    taken: dict[tuple[int, str], int] = {}
    for index, agent, n in plan:
        assert n > 0
        taken[(index, agent)] = taken.get((index, agent), 0) + n
    assert all(n <= lower[index][agent] for (index, agent), n in taken.items())
    for index, counts in enumerate(lower[:-1]):  # a lane is touched only once every less urgent one is empty
        if any(later == index + 1 for later, _ in taken):
            assert all(taken.get((index, agent), 0) == n for agent, n in counts.items())


def test_room_counts_only_what_may_be_moved() -> None:
    """a holds 40 of 40, b nothing: b's share is 20, but with only 5 of a's movable (the rest more urgent
    than b's requests) the room is 5; movable is asked for only when a share counts."""
    assert room({"a": 40}, "b", 40, 40, lambda: {"a": 5}) == 5
    assert room({"a": 40}, "b", 40, 40, lambda: {"a": 30}) == 20
    asked: list[bool] = []
    assert room({"a": 10}, "b", 10, 40, lambda: asked.append(True) or {}) == 30  # 30 free: no share counts
    assert not asked
