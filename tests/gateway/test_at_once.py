"""A lone realtime request served at once (issue 24 item 2): read with nothing behind it, for a pool with
nothing queued and a slot free, it skips its queue and the batcher's pass (PoolDispatcher.serve_at_once)
and is answered before its frame's handling returns, in one message with its Ack; in a burst, or behind
queued requests, it is queued as before. Real ZeroMQ sockets, the real null backend and CPU stage object,
a real gateway for the frame path."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import uvloop
import zmq

from edgewire import FrameCodec, pb
from gateway.dispatch.work import WorkItem
from gateway.ingress.reader import EdgeReader
from gateway.testing import fault_injecting_pools, fresh_requests, run_gateway, wait_for
from routing.types import Priority
from tests.gateway.daemon.test_serving import synthetic
from tests.gateway.test_backlog import received
from tests.gateway.test_pool_admission import Answers, pool, requests
from tests.gateway.test_realtime_fill import HeldPool, urgent

# --------------------------------------------------------------------------------------- the reader


def test_the_reader_says_whether_another_message_waits_now() -> None:
    """Three messages queued before the reader starts, each handler asking as it handles one: True, True,
    False; one sent later, alone: False. A True schedules a drain (its edge may be consumed by the ask);
    the reader reads every message either way."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind("inproc://more")
    dealer.connect("inproc://more")

    async def run() -> list[tuple[bytes, bool]]:
        seen: list[tuple[bytes, bool]] = []
        got = asyncio.Event()

        def deliver(frames: list[zmq.Frame]) -> None:
            seen.append((frames[1].bytes, reader.waiting_now()))
            got.set()

        reader = EdgeReader(router, deliver, lambda exc: None, 64)
        for body in (b"a", b"b", b"c"):
            dealer.send(body)  # inproc: in the ROUTER's pipe once sent
        reader.start()
        await asyncio.wait_for(_until(got, lambda: len(seen) == 3), 10)
        dealer.send(b"d")
        await asyncio.wait_for(_until(got, lambda: len(seen) == 4), 10)
        reader.stop()
        return seen

    try:
        assert uvloop.run(run()) == [(b"a", True), (b"b", True), (b"c", False), (b"d", False)]
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


async def _until(event: asyncio.Event, done: Callable[[], bool]) -> None:
    while not done():
        event.clear()
        await event.wait()


# ----------------------------------------------------------------------------------------- the pool


def lone() -> list[WorkItem]:
    return urgent(requests("a", 1, Priority.REALTIME, deadline=time.monotonic() + 30.0))


async def test_only_an_idle_pools_slice_of_urgent_realtime_requests_is_served_at_once() -> None:
    """Where the batcher's next pass would cut the slice as one batch, alone, and start it first and at
    once: realtime requests of a frame marked realtime, no realtime request queued in the pool and nothing
    in the slice's own queue (other models' less urgent requests may be), a slot free, no wait for company,
    the pool running; more than one only where they fit one batch (the model's limit, one length bucket)."""
    held = HeldPool()
    p = held.pool
    await p.backend.start()  # the null backend's demo models: their specs
    assert p.serves_at_once(lone())
    assert p.serves_at_once(urgent(requests("a", 2, Priority.REALTIME)))  # one batch of two
    p._max_batch = 2
    assert not p.serves_at_once(urgent(requests("a", 3, Priority.REALTIME)))  # the pass cuts two, then one
    texts = urgent(requests("a", 2, Priority.REALTIME))
    for item, tokens in zip(texts, (4, 4), strict=True):
        item.request.model_name, item.text_tokens = "text-encoder", tokens
    assert p.serves_at_once(texts)  # one length bucket
    texts[1].text_tokens = 20
    assert not p.serves_at_once(texts)  # two buckets: two queues, two batches
    dispatch = p.dispatch
    p.dispatch = dispatch.model_copy(update={"short_text_tokens": 24})
    assert p.serves_at_once(texts)  # both of up to 24 tokens: one queue (short_text_tokens), one batch
    p.dispatch = dispatch
    unknown = urgent(requests("a", 2, Priority.REALTIME))
    for item in unknown:
        item.request.model_name = "no-such-model"
    assert not p.serves_at_once(unknown)  # the pass answers those (MODEL_NOT_FOUND)
    assert not p.serves_at_once(requests("a", 1, Priority.REALTIME))  # a frame not marked realtime
    assert not p.serves_at_once(urgent(requests("a", 1, Priority.INTERACTIVE)))
    p._realtime_delay_s = 0.001  # realtime_queue_delay_us: the pass would wait for company
    assert not p.serves_at_once(lone())
    p._realtime_delay_s = 0.0
    # Another model's less urgent requests queued: the pass would cut the realtime one first, alone.
    other = requests("c", 2, Priority.BATCH)
    for item in other:
        item.request.model_name, item.text_tokens = "text-encoder", 4
    assert p.submit_many(other, time.monotonic())
    assert p.serves_at_once(lone())
    texts = urgent(requests("c", 1, Priority.REALTIME))
    texts[0].request.model_name, texts[0].text_tokens = "text-encoder", 4
    assert not p.serves_at_once(texts)  # its own queue holds requests: a batch takes it with them (fill)
    texts[0].text_tokens = 20
    assert p.serves_at_once(texts)  # another length bucket's queue: its own is empty
    queued = urgent(requests("d", 1, Priority.REALTIME))
    queued[0].request.model_name, queued[0].text_tokens = "text-encoder", 20
    assert p.submit_many(queued, time.monotonic())
    assert not p.serves_at_once(lone())  # a realtime request queued before it (any queue): it goes first
    assert len(p.take_queued()) == 3 and p.depth == 0
    assert p.submit_many(requests("b", 1, Priority.BATCH), time.monotonic())  # queued, not yet cut
    assert not p.serves_at_once(lone())  # behind a queued request: the pass decides the order
    p._batch_pass()  # b's batch takes the only slot (concurrency 1) and is held
    assert p.depth == 0 and p.inflight == 1
    assert not p.serves_at_once(lone())  # no slot free: the pass's realtime reserve decides
    await held.close()
    assert not p.serves_at_once(lone())  # stopped
    assert not pool(8, Answers()).serves_at_once(lone())  # never started


async def test_served_at_once_is_the_batch_and_the_counts_the_pass_would_make() -> None:
    """The same requests, one pool queueing them for its pass, the other serving them at once: the same
    batches start, in flight alike, and the agents' counts of requests served (fair queueing between the
    pool's queues, lanes.Counts) end the same; nothing is left queued."""
    queued, at_once = HeldPool(), HeldPool()
    for agent in ("a", "b", "a"):
        items = [urgent(requests(agent, 1, Priority.REALTIME)) for _ in range(2)]
        queued.submit(items[0])
        assert at_once.pool.serves_at_once(items[1])
        at_once.pool.serve_at_once(items[1])
        for held in (queued, at_once):
            held.release.set()
        await wait_for(lambda: not queued.pool.inflight and not at_once.pool.inflight, what="both batches")
        for held in (queued, at_once):
            held.release.clear()
    assert queued.started == at_once.started
    for counts in (queued.pool._counts, at_once.pool._counts):
        assert not counts.served and not counts.held and counts.by_class == [0, 0, 0]
    assert queued.pool._counts.gone == at_once.pool._counts.gone == {"a": 2, "b": 1}
    assert queued.pool._counts.virtual == at_once.pool._counts.virtual
    assert at_once.pool.depth == 0
    await queued.close()
    await at_once.close()


async def test_an_agent_with_requests_queued_is_served_at_once_beside_them() -> None:
    """An agent's batch request of another model waits in the pool; its lone realtime request is served at
    once, counted as a batch taken of it (it stays in fair queueing's counts while its other request is
    queued); the pass then serves the other one, and the agent leaves the counts having been served 2."""
    held = HeldPool()
    p = held.pool
    await p.backend.start()
    other = requests("a", 1, Priority.BATCH)
    other[0].request.model_name, other[0].text_tokens = "text-encoder", 4
    assert p.submit_many(other, time.monotonic())
    items = lone()  # agent "a" too
    assert p.serves_at_once(items)
    p.serve_at_once(items)  # takes the only slot (concurrency 1), held
    assert p.depth == 1 and p._counts.served == {"a": 1} and not p._counts.gone
    held.release.set()
    await wait_for(lambda: p.depth == 0 and not p.inflight, what="the queued request served by the pass")
    assert held.started[0][1] == ["a-realtime-0"] and held.started[1][1] == ["a-batch-0"]
    assert not p._counts.served and p._counts.gone == {"a": 2}
    await held.close()


# ------------------------------------------------------------------------------------ in a gateway


def frame(codec: FrameCodec, requests: list[pb.InferRequest], routing_id: bytes) -> list[zmq.Frame]:
    """A frame marked realtime (its requests keep their own classes)."""
    frames = codec.encode(
        pb.RequestBatch(requests=requests),
        agent_id="shopper",
        region="us-west",
        priority=pb.PRIORITY_CLASS_REALTIME,
        features=pb.FEATURE_ACKS_IN_RESPONSES,
    )
    return received(frames, routing_id)


async def served(
    models_dir: Path, requests: list[pb.InferRequest], more_waiting: bool
) -> tuple[int, list[pb.ResponseBatch], int]:
    """A realtime frame of ``requests`` handed to a real gateway's ingest (null backend: a batch is served
    before serve_at_once returns; one that waits, as ONNX Runtime on its threads, is a task that answers
    when done, as from a pass), ``more_waiting``: whether a message arrived while it was handled. What
    was sent before on_message returned (messages), every message sent by the time all are answered,
    and the requests the pools held queued right after on_message."""
    async with run_gateway(models_dir=models_dir, **fault_injecting_pools({"type": "null"})) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        sent: list[pb.ResponseBatch] = []

        def send(routing_id: bytes, frames: list[bytes | zmq.Frame]) -> str:
            payload = codec.decode([bytes(f) for f in frames]).payload
            assert isinstance(payload, pb.ResponseBatch)
            sent.append(payload)
            return "sent"

        carrier.send = send  # type: ignore[method-assign]
        carrier.more_waiting = lambda: more_waiting  # type: ignore[method-assign]
        ingest.on_message(carrier, frame(codec, requests, b"\x00S"))
        at_once, queued = len(sent), sum(p.depth for p in gw.pools.values())
        ids = {r.request_id for r in requests}
        await wait_for(
            lambda: {r.request_id for b in sent for r in b.responses} == ids, what="every request answered"
        )
        assert sum(p.depth for p in gw.pools.values()) == 0
        return at_once, sent, queued


def ranking(
    n: int, priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_REALTIME
) -> list[pb.InferRequest]:
    """``n`` copies of one ranking request of class ``priority`` (fresh ids): routed alike, one slice (its
    pipeline runs on the loop)."""
    requests = fresh_requests(synthetic(1, seed=71, kind=pb.REQUEST_KIND_RANKING) * n)
    for request in requests:
        request.priority = priority
    return requests


@pytest.mark.parametrize("more_waiting", [False, True])
async def test_a_lone_realtime_frame_is_answered_as_it_is_read_unless_a_message_arrived_meanwhile(
    models_dir: Path, more_waiting: bool
) -> None:
    """Nothing waiting on its carrier once the frame is handled: the request is answered before on_message
    returns, its answer and its Ack in one message. A message arrived meanwhile: queued for the batcher's
    pass, to batch with what that message brings; answered after it, in one message with its Ack all the
    same."""
    requests = ranking(1)
    at_once, sent, queued = await served(models_dir, requests, more_waiting)
    assert (at_once, queued) == ((0, 1) if more_waiting else (1, 0))
    (answer,) = sent
    assert [(r.request_id, r.status) for r in answer.responses] == [(requests[0].request_id, pb.STATUS_OK)]
    assert [list(a.accepted_ids) for a in answer.acks] == [[requests[0].request_id]]


async def test_a_small_realtime_frame_of_one_slice_is_answered_as_it_is_read(models_dir: Path) -> None:
    """Three realtime requests routed alike (one slice, one batch): served at once, all three answers and
    the Ack in one message before on_message returns."""
    requests = ranking(3)
    at_once, sent, queued = await served(models_dir, requests, more_waiting=False)
    assert (at_once, queued) == (1, 0)
    (answer,) = sent
    assert {r.request_id for r in answer.responses} == {r.request_id for r in requests}
    assert {r.status for r in answer.responses} == {pb.STATUS_OK}
    assert [set(a.accepted_ids) for a in answer.acks] == [{r.request_id for r in requests}]


async def test_a_small_realtime_frame_of_two_slices_is_queued_for_the_pass(models_dir: Path) -> None:
    """A ranking and a text request in one realtime frame (two slices): queued, so the pass cuts them as it
    always did; answered after it."""
    requests = ranking(1) + fresh_requests(synthetic(1, seed=72, kind=pb.REQUEST_KIND_TEXT))
    requests[1].priority = pb.PRIORITY_CLASS_REALTIME
    at_once, sent, queued = await served(models_dir, requests, more_waiting=False)
    assert (at_once, queued) == (0, 2)
    assert {r.status for b in sent for r in b.responses} == {pb.STATUS_OK}


async def test_a_realtime_request_beside_a_queued_one_of_its_frame_waits_for_the_pass(
    models_dir: Path,
) -> None:
    """A realtime ranking request and an interactive one of the same model in one realtime frame: the
    interactive one is queued while the frame is routed, so the realtime one, whose pool was idle when
    routed, is queued too (asked again before serving): the pass cuts them as it always did."""
    requests = ranking(1) + ranking(1, pb.PRIORITY_CLASS_INTERACTIVE)
    at_once, sent, queued = await served(models_dir, requests, more_waiting=False)
    assert (at_once, queued) == (0, 2)
    assert {r.status for b in sent for r in b.responses} == {pb.STATUS_OK}
