"""Request frames read now and served in turns (gateway/ingress/backlog.py): the backlog on its own, and a
real gateway, where a realtime frame read behind batch frames is served before them and nothing read is
lost (drain serves what waits, close drops it unacknowledged, a full backlog serves at once)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq

from edgewire import FrameCodec, pb
from gateway.ingest import Ingest
from gateway.ingress.backlog import Backlog
from gateway.testing import WireClient, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic

INTERACTIVE, REALTIME, BATCH = (
    pb.PRIORITY_CLASS_INTERACTIVE,
    pb.PRIORITY_CLASS_REALTIME,
    pb.PRIORITY_CLASS_BATCH,
)


# ------------------------------------------------------------------------------------- the backlog


async def test_the_backlog_serves_in_arrival_order_in_turns_of_its_own() -> None:
    """Nothing is served while the offering code runs; then the oldest first, every one, in turns of at
    least one item; ``failed`` gets an item whose serving raised and the rest go on."""
    served: list[int] = []
    failures: list[tuple[int, str]] = []

    def serve(item: int) -> None:
        if item == 2:
            raise ValueError("boom")
        served.append(item)

    backlog: Backlog[int] = Backlog(serve, lambda i, e: failures.append((i, str(e))), 10, 1 << 20, 0.0)
    assert all(backlog.offer(i, 100) for i in range(5))
    assert served == [] and len(backlog) == 5 and backlog.bytes == 500
    await wait_for(lambda: not backlog, what="the backlog worked off")
    assert served == [0, 1, 3, 4]
    assert failures == [(2, "boom")]
    assert backlog.bytes == 0


async def test_a_turn_serves_one_item_at_least_then_yields_once_its_budget_is_spent() -> None:
    """With no budget each turn serves one item and lets the loop run (another callback gets in between)."""
    order: list[str] = []
    backlog: Backlog[int] = Backlog(lambda i: order.append(f"item {i}"), lambda i, e: None, 10, 1 << 20, 0.0)
    for i in range(3):
        backlog.offer(i, 1)
    asyncio.get_running_loop().call_soon(lambda: order.append("other"))
    await wait_for(lambda: not backlog, what="the backlog worked off")
    assert order[:2] == ["item 0", "other"]
    assert order[2:] == ["item 1", "item 2"]


async def test_the_backlog_is_bounded_by_items_and_bytes() -> None:
    """A full backlog refuses (the caller serves the item at once); a lone item larger than ``max_bytes``
    still waits when nothing else does; 0 items: off."""
    backlog: Backlog[int] = Backlog(lambda i: None, lambda i, e: None, 2, 1000, 1.0)
    assert backlog.offer(1, 600)
    assert not backlog.offer(2, 600)  # 1,200 bytes
    assert backlog.offer(3, 400)
    assert not backlog.offer(4, 1)  # 2 items
    backlog.clear()
    assert backlog.offer(5, 5000)  # alone: waits
    off: Backlog[int] = Backlog(lambda i: None, lambda i, e: None, 0, 1000, 1.0)
    assert not off.offer(1, 1)


async def test_serve_all_serves_at_once_and_clear_forgets() -> None:
    served: list[int] = []
    backlog: Backlog[int] = Backlog(served.append, lambda i, e: None, 10, 1 << 20, 1.0)
    for i in range(3):
        backlog.offer(i, 1)
    assert backlog.serve_all() == 3 and served == [0, 1, 2] and not backlog
    for i in range(2):
        backlog.offer(i, 1)
    assert backlog.clear() == 2 and not backlog and backlog.bytes == 0
    await asyncio.sleep(0)  # the turn scheduled by the offers finds nothing
    assert served == [0, 1, 2]


# ------------------------------------------------------------------------------------- in a gateway


def message(
    codec: FrameCodec, requests: list[pb.InferRequest], priority: int, agent: str, routing_id: bytes
) -> list[zmq.Frame]:
    """A request frame as a carrier's ROUTER hands it over, [routing id, envelope, payload]: sent by a real
    DEALER (``routing_id``) to a ROUTER of the test's own, so it carries a peer's properties."""
    for request in requests:
        request.priority = priority  # type: ignore[assignment]
    frames = codec.encode(
        pb.RequestBatch(requests=requests),
        agent_id=agent,
        region="us-west",
        priority=priority,  # type: ignore[arg-type]
    )
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.RCVTIMEO, 10_000)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.setsockopt(zmq.ROUTING_ID, routing_id)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(frames)
        return router.recv_multipart(copy=False)
    finally:
        dealer.close(0)
        router.close(0)


def accepted(ingest: Ingest, requests: list[pb.InferRequest]) -> list[bool]:
    now = time.monotonic()
    return [ingest.dedupe.state(r.request_id, now) is not None for r in requests]


async def test_a_realtime_frame_read_behind_batch_frames_is_served_before_them(models_dir: Path) -> None:
    """Frames read in one reader turn: the batch and interactive ones wait in the backlog, the realtime one
    (and a Ping) is served as it is read; the others follow in the backlog's turns, every request served."""
    async with run_gateway(models_dir=models_dir) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        loads = [synthetic(30, seed=40 + i) for i in range(3)]
        lone = synthetic(1, seed=50)
        for i, load in enumerate(loads):
            ingest.on_message(carrier, message(codec, load, (BATCH, INTERACTIVE)[i % 2], "loader", b"\x00L"))
        ingest.on_message(carrier, message(codec, lone, REALTIME, "shopper", b"\x00S"))
        # Still in the turn that read them: only the realtime frame has been taken.
        assert accepted(ingest, lone) == [True]
        assert not any(accepted(ingest, [r for load in loads for r in load]))
        assert len(ingest.backlog) == 3
        assert counted(gw, "hkgw_ingest_backlog_frames") == 3
        await wait_for(lambda: not ingest.backlog, what="the backlog worked off")
        assert all(accepted(ingest, [r for load in loads for r in load]))
        assert counted(gw, "hkgw_ingest_backlog_frames") == 0


async def test_frames_read_while_draining_or_into_a_full_backlog_are_served_at_once(models_dir: Path) -> None:
    async with run_gateway(models_dir=models_dir, limits={"backlog_frames": 1}) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        first, second = synthetic(5, seed=60), synthetic(5, seed=61)
        ingest.on_message(carrier, message(codec, first, BATCH, "loader", b"\x00L"))
        ingest.on_message(carrier, message(codec, second, BATCH, "loader", b"\x00L"))
        assert accepted(ingest, first) == [False] * 5  # waits
        assert accepted(ingest, second) == [True] * 5  # the backlog was full: served as read
        await wait_for(lambda: not ingest.backlog, what="the backlog worked off")
        ingest.draining = True
        ingest.on_message(carrier, message(codec, synthetic(5, seed=62), BATCH, "loader", b"\x00L"))
        assert not ingest.backlog  # answered as it is read: nacked DRAINING
        assert counted(gw, "hkgw_requests_nacked_total", reason="draining") == 5
        ingest.draining = False


async def test_drain_serves_the_frames_waiting_and_close_drops_them(models_dir: Path) -> None:
    """Frames in the backlog when the drain settles are served then (their requests answered, as draining,
    before the replies are flushed); after close the backlog is empty and off."""
    async with run_gateway(models_dir=models_dir) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        waiting = synthetic(5, seed=70)
        ingest.on_message(carrier, message(codec, waiting, BATCH, "loader", b"\x00L"))
        assert len(ingest.backlog) == 1
        ingest.draining = True
        assert await ingest.settle(5.0)
        assert not ingest.backlog
        assert counted(gw, "hkgw_requests_nacked_total", reason="draining") == 5
        ingest.draining = False
        ingest.on_message(carrier, message(codec, synthetic(5, seed=71), BATCH, "loader", b"\x00L"))
        assert len(ingest.backlog) == 1
        ingest.close()
        assert not ingest.backlog and ingest.backlog.max_items == 0


async def test_agents_sending_batches_and_realtime_requests_have_every_one_answered(models_dir: Path) -> None:
    """Over real sockets: one agent's batch frames and another's realtime requests, all in flight at once,
    every request answered OK once (nothing read into the backlog is lost or served twice)."""
    async with (
        run_gateway(models_dir=models_dir) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="loader") as loader,
        WireClient(gw.endpoint("hgc"), agent_id="shopper") as shopper,
    ):
        loads = [synthetic(40, seed=80 + i) for i in range(4)]
        lone = synthetic(6, seed=90)
        for load in loads:
            for r in load:
                r.priority = BATCH
            await loader.send(load, priority=BATCH)
        for r in lone:
            r.priority = REALTIME
            await shopper.send([r], priority=REALTIME)
        answers = await loader.wait_responses([r.request_id for load in loads for r in load])
        answers += await shopper.wait_responses([r.request_id for r in lone])
        assert loader.duplicate_responses == shopper.duplicate_responses == 0
    assert len(answers) == 4 * 40 + 6
    assert {a.status for a in answers} == {pb.STATUS_OK}
    assert len({a.request_id for a in answers}) == len(answers)


def counted(gw: object, name: str, **labels: str) -> float:
    registry = gw.metrics.registry  # type: ignore[attr-defined]
    return float(registry.get_sample_value(name, labels) or 0.0)
