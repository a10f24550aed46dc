"""The dedupe window: states, expiry, the count bound, and what an id costs in memory; the response
cache's memory bound."""

from __future__ import annotations

import os
import tracemalloc

from edgewire import new_id
from gateway.dedupe import DedupeWindow, RequestState, ResponseCache


def test_an_accepted_id_is_pending_then_done_until_its_window_ends() -> None:
    """Accept -> PENDING, done -> DONE, and after window_s the id is unknown again."""
    window = DedupeWindow(window_s=10.0, max_entries=1000)
    rid = new_id()
    assert window.state(rid, 0.0) is None
    window.accept(rid, 1.0)
    assert window.state(rid, 2.0) is RequestState.PENDING
    window.done(rid)
    assert window.state(rid, 10.9) is RequestState.DONE
    assert window.state(rid, 11.0) is None
    window.accept(new_id(), 11.5)  # expiry is applied on accept
    assert len(window) == 1


def test_the_count_bound_evicts_the_oldest_and_counts_it() -> None:
    """Past max_entries the oldest ids go first, before their time, and each is counted."""
    window = DedupeWindow(window_s=100.0, max_entries=1000)
    ids = [new_id() for _ in range(1003)]
    for i, rid in enumerate(ids):
        window.accept(rid, float(i) / 1000)
    assert len(window) == 1000
    assert window.evicted_early == 3
    assert all(window.state(rid, 2.0) is None for rid in ids[:3])
    assert all(window.state(rid, 2.0) is RequestState.PENDING for rid in ids[3:])


def test_accepting_a_frame_s_ids_at_once_equals_accepting_them_one_by_one() -> None:
    """accept_many leaves the window as accept() per id does: entries, expiries, evictions at the bound."""
    frames = [[new_id() for _ in range(n)] for n in (40, 1, 70, 33)]
    one, many = DedupeWindow(window_s=0.5, max_entries=100), DedupeWindow(window_s=0.5, max_entries=100)
    for t, ids in enumerate(frames):
        now = 0.2 * t
        for rid in ids:
            one.accept(rid, now)
        many.accept_many(ids, now)
        assert len(one) == len(many)
        assert one.evicted_early == many.evicted_early
        everything = [rid for f in frames for rid in f]
        for later in (now, now + 0.3, now + 0.6):
            assert [one.state(r, later) for r in everything] == [many.state(r, later) for r in everything]
    assert many.evicted_early > 0  # the bound was reached


def test_a_forgotten_id_is_served_again_and_tracked_from_its_new_acceptance() -> None:
    """forget() makes a resend new; accepted again, it lives for a full window from then."""
    window = DedupeWindow(window_s=10.0, max_entries=1000)
    rid, other = new_id(), new_id()
    window.accept(rid, 0.0)
    window.accept(other, 1.0)
    window.forget(rid)
    assert window.state(rid, 2.0) is None
    window.accept(rid, 5.0)
    window.accept(new_id(), 12.0)  # past the first acceptance's end: its stale slot goes, the id stays
    assert window.state(rid, 12.0) is RequestState.PENDING
    assert window.state(other, 12.0) is None
    assert window.state(rid, 15.0) is None


def test_an_id_costs_under_200_bytes() -> None:
    """Millions of ids sit in the window at full rate: each costs its 16-byte id, an expiry and a slot."""
    ids = [new_id() for _ in range(100_000)]
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        window = DedupeWindow(window_s=600.0, max_entries=2_000_000)
        for i, rid in enumerate(ids):
            window.accept(rid, 1.0 + i * 1e-6)
        for rid in ids[::2]:
            window.done(rid)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(window) == len(ids)
    assert (after - before) / len(ids) < 200


def test_the_response_cache_bound_is_its_memory_not_only_its_payload() -> None:
    """response_cache_bytes bounds what the cache really holds: with 600-byte answers (a ranking answer's
    size) the memory traced for a full cache stays within 10% of the bound, and the oldest go first."""
    bound = 8 << 20
    answers = [(os.urandom(16), os.urandom(600)) for _ in range(30_000)]  # ~18 MB of payload: 2x over
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        cache = ResponseCache(bound)
        for rid, data in answers:
            cache.put(bytes(bytearray(rid)), bytes(bytearray(data)))  # fresh objects, as in the gateway
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.nbytes <= bound
    assert 0.9 * bound <= held <= 1.1 * bound
    assert cache.get(answers[0][0]) is None
    assert cache.get(answers[-1][0]) == answers[-1][1]


def test_marking_a_batch_done_at_once_equals_one_by_one() -> None:
    """done_many leaves every id as done() per id does: pending ones DONE, unknown or expired ones alone."""
    ids = [new_id() for _ in range(30)]
    one, many = DedupeWindow(window_s=10.0, max_entries=100), DedupeWindow(window_s=10.0, max_entries=100)
    for window in (one, many):
        window.accept_many(ids[:20], 0.0)
        window.done(ids[3])
    for rid in ids[::2]:
        one.done(rid)
    many.done_many(ids[::2])
    assert [one.state(r, 5.0) for r in ids] == [many.state(r, 5.0) for r in ids]
    assert many.state(ids[0], 5.0) is RequestState.DONE and many.state(ids[1], 5.0) is RequestState.PENDING


def test_caching_a_batch_at_once_keeps_what_caching_one_by_one_keeps() -> None:
    """put_many ends with the entries and bytes of put() per pair: the newest that fit, a re-put moved to
    the end, one over the bound alone skipped."""
    bound = 10 * (300 + 190)
    sizes = [300, 40, 5000, 300, 700, 300, 1, 300, 300, 2000, 300]
    ids = [new_id() for _ in sizes]
    ids[7] = ids[1]  # a re-put
    pairs = [(rid, bytes(n)) for rid, n in zip(ids, sizes, strict=True)]
    one, many = ResponseCache(bound), ResponseCache(bound)
    for rid, data in pairs[:3]:
        one.put(rid, data)
        many.put(rid, data)
    for rid, data in pairs[3:]:
        one.put(rid, data)
    many.put_many([r for r, _ in pairs[3:]], [d for _, d in pairs[3:]])
    assert one.nbytes == many.nbytes <= bound
    assert len(one) == len(many)
    assert [one.get(r) for r in ids] == [many.get(r) for r in ids]
