"""The deadline heap the uplink and the spool expire with: what is due comes out, in order, and only that."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from edge_agent.deadlines import COMPACT_FLOOR, DeadlineHeap


def test_pop_due_returns_what_is_due_earliest_first_and_keeps_the_rest() -> None:
    """Keys due at or before now come out in due order; later ones stay, with the next due time."""
    heap: DeadlineHeap[str] = DeadlineHeap()
    for key, due in (("c", 3.0), ("a", 1.0), ("d", 9.0), ("b", 2.0)):
        heap.set(key, due)
    assert heap.pop_due(3.0) == ["a", "b", "c"]
    assert len(heap) == 1 and "d" in heap and "a" not in heap
    assert heap.next_due() == 9.0
    assert heap.pop_due(8.999) == []


def test_set_moves_a_key_and_discard_forgets_it() -> None:
    """A key set again is due at its new time only; a discarded key never comes out."""
    heap: DeadlineHeap[int] = DeadlineHeap()
    heap.set(1, 1.0)
    heap.set(2, 2.0)
    heap.set(1, 5.0)
    heap.discard(2)
    heap.discard(99)  # not held: nothing happens
    assert heap.next_due() == 5.0
    assert heap.due(1) == 5.0 and heap.due(2) is None
    assert heap.pop_due(4.0) == []
    assert heap.pop_due(5.0) == [1]
    assert len(heap) == 0 and heap.next_due() is None


def test_removed_keys_do_not_pile_up_in_the_heap() -> None:
    """Keys answered long before their deadline (most of them) leave the heap bounded by the live keys."""
    heap: DeadlineHeap[int] = DeadlineHeap()
    for n in range(100_000):
        heap.set(n, 1e9 + n)  # far deadlines: none surfaces on its own
        if n >= 10:
            heap.discard(n - 10)  # ten live at a time
    assert len(heap) == 10
    assert heap.heap_size <= max(COMPACT_FLOOR, 2 * len(heap)) + 1
    assert heap.pop_due(2e9) == list(range(99_990, 100_000))


def test_the_cost_of_pop_due_follows_what_expires() -> None:
    """With 20k keys held and three due, pop_due looks at a handful of heap entries, not 20k."""
    heap: DeadlineHeap[int] = DeadlineHeap()
    for n in range(20_000):
        heap.set(n, 100.0 + n)
    before = heap.heap_size
    assert heap.pop_due(102.0) == [0, 1, 2]
    assert heap.heap_size == before - 3


@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "discard", "pop"]), st.integers(0, 20), st.floats(0, 100)),
        max_size=200,
    )
)
def test_matches_a_plain_dict_of_due_times(ops: list[tuple[str, int, float]]) -> None:
    """Any sequence of set / discard / pop_due agrees with a dict scanned in full (the old way)."""
    heap: DeadlineHeap[int] = DeadlineHeap()
    model: dict[int, float] = {}
    for op, key, at in ops:
        if op == "set":
            heap.set(key, at)
            model[key] = at
        elif op == "discard":
            heap.discard(key)
            model.pop(key, None)
        else:
            due = sorted((t, k) for k, t in model.items() if t <= at)
            popped = heap.pop_due(at)
            assert sorted(popped) == sorted(k for _, k in due)
            assert [model[k] for k in popped] == sorted(model[k] for k in popped)
            for k in popped:
                del model[k]
        assert len(heap) == len(model)
        assert heap.next_due() == (min(model.values()) if model else None)


def test_ties_and_random_order() -> None:
    """Equal due times all come out; a shuffled insert order comes out sorted by due time."""
    rng = random.Random(4)
    heap: DeadlineHeap[int] = DeadlineHeap()
    dues = {n: float(rng.randint(0, 50)) for n in range(500)}
    for n in rng.sample(list(dues), len(dues)):
        heap.set(n, dues[n])
    popped = heap.pop_due(50.0)
    assert sorted(popped) == list(range(500))
    assert [dues[n] for n in popped] == sorted(dues.values())
