"""The uplink's pacing parts on their own: the send window, the send queue's lanes, retry-after jitter."""

from __future__ import annotations

from edge_agent.uplink.outstanding import OutstandingTable, SentFrame
from edge_agent.uplink.pacing import SendWindow
from edge_agent.uplink.send_queue import SendQueue
from edgewire import new_id, pb


def test_the_window_doubles_per_round_of_answers_and_halves_once_per_round_of_refusals() -> None:
    """Slow start opens the window by one per answer while it is in use; an OVERLOADED refusal halves
    it, refusals of requests sent before that cut do not cut again, and growth is additive after it."""
    window = SendWindow(initial=8, minimum=2, maximum=1000)
    assert window.room(held=0) == 8 and window.room(held=8) == 0
    window.answered(8, held=8)  # a full window answered: doubled
    assert window.room(held=0) == 16
    assert window.overloaded(sent_at=1.0, now=2.0)
    assert window.room(held=0) == 8
    assert not window.overloaded(sent_at=1.5, now=2.1)  # sent before the cut: the same round
    assert window.room(held=0) == 8
    window.answered(8, held=8)  # above the threshold: +1 per window's worth of answers
    assert window.room(held=0) == 9
    assert window.overloaded(sent_at=2.5, now=3.0)  # sent after the cut: a new round
    assert (window.cuts, window.room(held=0)) == (2, 4)


def test_an_idle_window_does_not_grow_and_a_restart_starts_it_again() -> None:
    """Answers while less than half the window is in use leave it as it is (a burst later meets a window
    the gateway has been seen to hold); a gateway restart puts it back to its initial size."""
    window = SendWindow(initial=64, minimum=8, maximum=100)
    for _ in range(1000):
        window.answered(1, held=10)
    assert window.room(held=0) == 64
    window.answered(64, held=64)
    assert window.room(held=0) == 100  # bounded by the maximum (uplink.max_inflight)
    window.overloaded(sent_at=0.0, now=0.0)
    window.restart(now=1.0)
    assert window.room(held=0) == 64 and window.restarts == 1


def test_the_table_counts_what_the_gateway_holds() -> None:
    """Sent requests are held until answered or released for a resend; each is counted once."""
    table = OutstandingTable(answered_window=8)
    requests = [pb.InferRequest(request_id=new_id()) for _ in range(3)]
    for request in requests:
        table.add(request)
    ids = [r.request_id for r in requests]
    table.sent(SentFrame(b"m1", "a", ids, sent_at=1.0), ack_timeout_s=1.0)
    table.sent(SentFrame(b"m2", "b", ids[:1], sent_at=2.0), ack_timeout_s=1.0)  # a resend, still held
    assert table.held == 3
    entry = table.get(ids[1])
    assert entry is not None and table.release(entry) and not table.release(entry)
    table.close(ids[0])
    table.close(ids[1])
    assert table.held == 1


def test_the_queue_sends_realtime_first_and_holds_back_what_waits_out_a_retry_after() -> None:
    """A realtime request queued behind a batch backlog goes in the next frame, alone: a frame holds one
    class (its envelope's priority is every request's); a request refused with a retry-after stays out of
    frames until it has passed, then goes ahead of newer ones."""
    table = OutstandingTable(answered_window=64)
    queue = SendQueue()
    backlog = [pb.InferRequest(request_id=new_id(), priority=pb.PRIORITY_CLASS_BATCH) for _ in range(5)]
    urgent = pb.InferRequest(request_id=new_id(), priority=pb.PRIORITY_CLASS_REALTIME)
    for request in [*backlog, urgent]:
        table.add(request)
        queue.push(table, [request.request_id])
    first = queue.take(table, now=10.0, wall_us=0, max_records=2, max_bytes=1 << 20, idle_wait_s=1.0)
    assert [r.request_id for r in first.requests] == [urgent.request_id]
    batch = queue.take(table, now=10.0, wall_us=0, max_records=1, max_bytes=1 << 20, idle_wait_s=1.0)
    assert [r.request_id for r in batch.requests] == [backlog[0].request_id]
    refused = table.get(backlog[0].request_id)
    assert refused is not None
    refused.not_before = 10.5
    queue.push(table, [backlog[0].request_id])
    second = queue.take(table, now=10.1, wall_us=0, max_records=10, max_bytes=1 << 20, idle_wait_s=1.0)
    assert [r.request_id for r in second.requests] == [r.request_id for r in backlog[1:]]
    idle = queue.take(table, now=10.2, wall_us=0, max_records=10, max_bytes=1 << 20, idle_wait_s=1.0)
    assert idle.requests == [] and idle.wait_s is not None and abs(idle.wait_s - 0.3) < 1e-9
    late = pb.InferRequest(request_id=new_id(), priority=pb.PRIORITY_CLASS_BATCH)
    table.add(late)
    queue.push(table, [late.request_id])
    third = queue.take(table, now=10.5, wall_us=0, max_records=10, max_bytes=1 << 20, idle_wait_s=1.0)
    assert [r.request_id for r in third.requests] == [backlog[0].request_id, late.request_id]


def test_the_realtime_reserve_takes_realtime_requests_only_and_counts_them_held() -> None:
    """Past a full send window the uplink sends from the realtime lane only (``realtime_only``), and the
    table counts the realtime requests the gateway holds (``held_realtime``) as frames go and are answered."""
    table = OutstandingTable(answered_window=64)
    queue = SendQueue()
    batch = [pb.InferRequest(request_id=new_id(), priority=pb.PRIORITY_CLASS_BATCH) for _ in range(3)]
    for request in batch:
        table.add(request)
        queue.push(table, [request.request_id])
    assert not queue.realtime_waiting
    none = queue.take(table, 10.0, 0, 10, 1 << 20, 1.0, realtime_only=True)
    assert none.requests == [] and none.wait_s == 1.0
    urgent = [pb.InferRequest(request_id=new_id(), priority=pb.PRIORITY_CLASS_REALTIME) for _ in range(2)]
    for request in urgent:
        table.add(request)
        queue.push(table, [request.request_id])
    assert queue.realtime_waiting
    chosen = queue.take(table, 10.0, 0, 10, 1 << 20, 1.0, realtime_only=True)
    assert chosen.requests == urgent  # the batch requests stay queued
    assert not queue.realtime_waiting and len(queue) == 3
    table.sent(SentFrame(new_id(), "hgc", [r.request_id for r in urgent], sent_at=10.0), ack_timeout_s=1.0)
    assert (table.held, table.held_realtime) == (2, 2)
    answered = table.get(urgent[0].request_id)
    assert answered is not None and table.release(answered)
    assert (table.held, table.held_realtime) == (1, 1)
    table.close(urgent[1].request_id)
    assert (table.held, table.held_realtime) == (0, 0)
