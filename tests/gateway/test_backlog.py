"""Request frames read now and served in turns (gateway/ingress/backlog.py): the backlog on its own, and a
real gateway, where a realtime frame read behind batch frames is served before them, one agent's frames
do not hold another's back, and nothing read is lost (drain serves what waits, close drops it
unacknowledged, a full backlog serves at once)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from edgewire import FrameCodec, pb
from gateway.config import load_config
from gateway.ingest import FRAME_WORK_BYTES, Ingest
from gateway.ingress.backlog import Backlog
from gateway.server import Gateway
from gateway.testing import WireClient, loopback_overrides, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic
from tests.test_protocol_conformance import running

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


async def test_a_full_backlog_serves_its_oldest_to_make_room_and_zero_turns_it_off() -> None:
    """Bounded by items and by bytes: an item offered to a full backlog waits after the oldest ones have
    been served now (arrival order kept); a lone item larger than ``max_bytes`` still waits when nothing
    else does; 0 items or 0 bytes: off (the caller serves every item at once)."""
    served: list[int] = []
    backlog: Backlog[int] = Backlog(served.append, lambda i, e: None, 2, 1000, 1.0)
    assert backlog.offer(1, 600)
    assert backlog.offer(2, 600) and served == [1]  # 1,200 bytes: the oldest served to make room
    assert backlog.offer(3, 300) and served == [1]
    assert backlog.offer(4, 1) and served == [1, 2]  # 2 items
    assert backlog.serve_all() == 2 and served == [1, 2, 3, 4]
    assert backlog.offer(5, 5000) and served == [1, 2, 3, 4]  # alone: waits
    assert backlog.serve_all() == 1
    for off in (
        Backlog[int](served.append, lambda i, e: None, 0, 1000, 1.0),
        Backlog[int](served.append, lambda i, e: None, 5, 0, 1.0),
    ):
        assert not off.offer(9, 1) and not off


async def test_each_owners_items_in_order_the_owners_in_turn() -> None:
    """An owner with many items waiting does not hold the others back: items of equal work, a quantum of
    one item: one item of each owner in turn, each owner's in the order offered; ``serve_all`` too."""
    served: list[str] = []
    backlog: Backlog[str] = Backlog(served.append, lambda i, e: None, 100, 1 << 20, 0.0, quantum=1)
    for item in ("a0", "a1", "a2", "a3"):
        backlog.offer(item, 1, "flood")
    backlog.offer("b0", 1, "shop")
    backlog.offer("c0", 1, "search")
    backlog.offer("b1", 1, "shop")
    assert backlog.owners == 3
    await wait_for(lambda: not backlog, what="the backlog worked off")
    assert served == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert backlog.owners == 0 and backlog.bytes == 0
    served.clear()
    for item in ("a0", "a1"):
        backlog.offer(item, 1, "flood")
    backlog.offer("b0", 1, "shop")
    assert backlog.serve_all() == 3 and served == ["a0", "b0", "a1"]


async def test_owners_share_the_turns_by_the_work_of_their_items() -> None:
    """Deficit round robin: per round each owner may have a quantum of work served; an owner of items a
    tenth the size of another's gets ten of them served for each of the other's."""
    served: list[str] = []
    backlog: Backlog[str] = Backlog(served.append, lambda i, e: None, 100, 1 << 20, 0.0, quantum=100)
    for i in range(3):
        backlog.offer(f"a{i}", 50_000, "flood", work=100)  # bytes held and work are apart
    for i in range(15):
        backlog.offer(f"s{i}", 10, "shop")  # work: its bytes
    await wait_for(lambda: not backlog, what="the backlog worked off")
    assert served == ["a0", *(f"s{i}" for i in range(10)), "a1", *(f"s{i}" for i in range(10, 15)), "a2"]


async def test_a_full_backlog_serves_the_oldest_of_the_owner_holding_the_most() -> None:
    """Room is made at the cost of the owner holding the most items (when full by items) or bytes (when
    full by bytes), not of whoever waited longest (items of equal work here, one a round)."""
    served: list[str] = []
    backlog: Backlog[str] = Backlog(served.append, lambda i, e: None, 4, 1 << 20, 1.0, quantum=1)
    backlog.offer("shop0", 10, "shop", work=1)  # the oldest
    for item in ("a0", "a1", "a2"):
        backlog.offer(item, 10, "flood", work=1)
    backlog.offer("c0", 10, "search", work=1)  # 4 items waiting: full
    assert served == ["a0"]
    assert backlog.serve_all() == 4 and served == ["a0", "shop0", "a1", "c0", "a2"]
    served.clear()
    by_bytes: Backlog[str] = Backlog(served.append, lambda i, e: None, 100, 1000, 1.0, quantum=1)
    by_bytes.offer("shop0", 700, "shop", work=1)
    for item in ("a0", "a1", "a2"):
        by_bytes.offer(item, 10, "flood", work=1)
    by_bytes.offer("c0", 290, "search", work=1)  # 1,020 bytes: shop holds 700 of them
    assert served == ["shop0"]
    assert by_bytes.serve_all() == 4 and served == ["shop0", "a0", "c0", "a1", "a2"]


async def test_serve_all_serves_at_once_and_close_forgets_and_takes_no_more() -> None:
    served: list[int] = []
    backlog: Backlog[int] = Backlog(served.append, lambda i, e: None, 10, 1 << 20, 1.0)
    for i in range(3):
        backlog.offer(i, 1)
    assert backlog.serve_all() == 3 and served == [0, 1, 2] and not backlog
    for i in range(2):
        backlog.offer(i, 1)
    assert backlog.close() == 2 and not backlog and backlog.bytes == 0
    assert not backlog.offer(7, 1)  # closed: the caller serves it
    after_the_turn = asyncio.Event()
    asyncio.get_running_loop().call_soon(after_the_turn.set)  # behind the turn the offers scheduled
    await after_the_turn.wait()
    assert served == [0, 1, 2]  # that turn found nothing


# ------------------------------------------------------------------------------------- in a gateway


def message(
    codec: FrameCodec, requests: list[pb.InferRequest], priority: int, agent: str, routing_id: bytes
) -> list[zmq.Frame]:
    """A request frame as a carrier's ROUTER hands it over (:func:`received`)."""
    for request in requests:
        request.priority = priority  # type: ignore[assignment]
    frames = codec.encode(
        pb.RequestBatch(requests=requests),
        agent_id=agent,
        region="us-west",
        priority=priority,  # type: ignore[arg-type]
    )
    return received(frames, routing_id)


def received(frames: list[bytes], routing_id: bytes) -> list[zmq.Frame]:
    """``frames`` as a carrier's ROUTER hands them over, [routing id, envelope, payload]: sent by a real
    DEALER (``routing_id``) to a ROUTER of the test's own, so they carry a peer's properties."""
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
    """Frames read in one reader turn: the batch and interactive ones wait in the backlog, the realtime one is
    served as it is read; the others follow in the backlog's turns, every request served."""
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


async def test_a_full_backlog_serves_its_oldest_frame_and_nothing_waits_while_draining(
    models_dir: Path,
) -> None:
    async with run_gateway(models_dir=models_dir, limits={"backlog_frames": 1}) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        first, second = synthetic(5, seed=60), synthetic(5, seed=61)
        ingest.on_message(carrier, message(codec, first, BATCH, "loader", b"\x00L"))
        assert accepted(ingest, first) == [False] * 5  # waits
        ingest.on_message(carrier, message(codec, second, BATCH, "loader", b"\x00L"))
        assert accepted(ingest, first) == [True] * 5  # served to make room: arrival order kept
        assert accepted(ingest, second) == [False] * 5
        await wait_for(lambda: not ingest.backlog, what="the backlog worked off")
        assert accepted(ingest, second) == [True] * 5
        ingest.draining = True
        ingest.on_message(carrier, message(codec, synthetic(5, seed=62), BATCH, "loader", b"\x00L"))
        assert not ingest.backlog  # answered as it is read: nacked DRAINING
        assert counted(gw, "hkgw_requests_nacked_total", reason="draining") == 5
        ingest.draining = False


async def test_the_budget_admits_a_waiting_frame_against_what_the_frames_before_it_cost(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Frames of one agent read together and waiting in the backlog are admitted one by one when their
    turn comes, each after the decode time of the ones before it was charged: with a decode budget of 50 ms
    and 30 ms of CPU per parse, two of ten are decoded and eight refused over_budget (admitted when read,
    all ten were)."""
    budget = {"decode_s_per_s": 0.001, "burst_decode_s": 0.05}
    async with run_gateway(models_dir=models_dir, budget=budget) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        async with WireClient(gw.endpoint("pccw"), agent_id="warm-up") as warm:  # the pools up and routed to
            assert [a.status for a in await warm.infer(synthetic(1, seed=99))] == [pb.STATUS_OK]
        codec = FrameCodec()
        parse = ingest._codec.parse_payload

        parsed: list[int] = []

        def slow_parse(*args: Any, **kwargs: Any) -> Any:
            parsed.append(1)
            end = time.thread_time() + 0.03  # CPU, as the budget counts it
            while time.thread_time() < end:
                pass
            return parse(*args, **kwargs)

        monkeypatch.setattr(ingest._codec, "parse_payload", slow_parse)
        frames = [synthetic(2, seed=100 + i) for i in range(10)]
        for requests in frames:
            ingest.on_message(carrier, message(codec, requests, INTERACTIVE, "parser", b"\x00P"))
        await wait_for(lambda: not ingest.backlog, what="the backlog worked off")
        decoded = len(parsed)
        refused = counted(gw, "hkgw_frames_rejected_total", carrier="hgc", reason="over_budget")
    assert (decoded, refused) == (2, 8)


async def test_an_agents_small_frames_are_not_held_behind_another_agents_large_ones(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One agent's frames of 100 requests wait in the backlog; another agent's lone requests read after them
    are served after one of them, not after all: the agents share the turns by their frames' work (bytes,
    the larger of sent and declared decompressed, and a frame's own cost), one frame a turn here, the
    quantum set to one large frame's work."""
    async with run_gateway(models_dir=models_dir) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        codec = FrameCodec()
        floods = [message(codec, synthetic(100, seed=130 + i), BATCH, "loader", b"\x00L") for i in range(4)]
        shop = [
            message(codec, synthetic(1, seed=140 + i), INTERACTIVE, "shopper", b"\x00S") for i in range(3)
        ]

        def work(frames: list[zmq.Frame]) -> int:
            declared = pb.Envelope.FromString(frames[1].bytes).uncompressed_length
            return max(len(frames[2].bytes), declared) + FRAME_WORK_BYTES

        quantum = max(work(f) for f in floods)
        assert 3 * max(work(f) for f in shop) < quantum
        monkeypatch.setattr(ingest.backlog, "_budget_s", 0.0)
        monkeypatch.setattr(ingest.backlog, "_quantum", quantum)
        order: list[str] = []
        serve = ingest.backlog._serve

        def noted(read: Any) -> None:
            order.append(read[0].agent_id)
            serve(read)

        monkeypatch.setattr(ingest.backlog, "_serve", noted)
        for frames in floods + shop:
            ingest.on_message(carrier, frames)
        assert len(ingest.backlog) == 7 and ingest.backlog.owners == 2
        await wait_for(lambda: not ingest.backlog, what="the backlog worked off")
    assert order == ["loader", "shopper", "shopper", "shopper", "loader", "loader", "loader"]


async def test_frames_waiting_at_a_reload_are_served_before_it(models_dir: Path) -> None:
    """A SIGHUP reload serves what waits first: frames read before it meet the keys and the routing policy
    they were read under, not the new ones."""
    overrides = loopback_overrides(models_dir)
    async with running(Gateway(load_config(environ={}, overrides=overrides), overrides=overrides)) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        waiting = synthetic(5, seed=110)
        ingest.on_message(carrier, message(FrameCodec(), waiting, BATCH, "loader", b"\x00L"))
        assert len(ingest.backlog) == 1
        assert gw.reload()
        assert not ingest.backlog
        assert accepted(ingest, waiting) == [True] * 5


async def test_a_reload_gives_the_pools_the_queue_bounds_routing_reads(models_dir: Path) -> None:
    """A SIGHUP reload that changes a pool's max_queue_depth and concurrency in [[routing.pools]]: routing
    reads the new bound, and so does the pool's queue (it kept the first one before: routing and the
    queue could disagree on when the pool is full)."""
    overrides = loopback_overrides(models_dir)
    # The routing section as the config file's: edited in place below, as the file would be before SIGHUP.
    overrides["routing"] = load_config(environ={}, overrides=overrides).routing.model_dump(mode="json")
    async with running(Gateway(load_config(environ={}, overrides=overrides), overrides=overrides)) as gw:
        cpu = gw.pools["cpu"]
        before = (cpu.max_queue_depth, cpu.concurrency)
        for pool in overrides["routing"]["pools"]:
            if pool["name"] == "cpu":
                pool["max_queue_depth"], pool["concurrency"] = 7, before[1] + 1
        assert gw.reload()
        assert (cpu.max_queue_depth, cpu.concurrency) == (7, before[1] + 1) != before


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


def latency_totals(gw: Gateway) -> tuple[float, float]:
    """(sum, count) of hkgw_request_latency_seconds over every label."""
    total = count = 0.0
    for family in gw.metrics.registry.collect():
        if family.name == "hkgw_request_latency_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
    return total, count


async def test_a_frames_wait_in_the_backlog_is_in_its_requests_latency(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Receipt is when the reader took the frame: the time it waited for its turn is in its answers'
    latency (the histogram, and so ``timing.total_us``), not hidden before it. The frame is read with the
    ingest clock ``wait_s`` behind, as if it had waited that long (no busy loop, nothing timed)."""
    wait_s = 30.0
    async with run_gateway(models_dir=models_dir) as gw:
        ingest, carrier = gw.ingest, gw.carriers["hgc"]
        assert ingest is not None
        async with WireClient(gw.endpoint("pccw"), agent_id="warm-up") as warm:  # the pools up and routed to
            assert [a.status for a in await warm.infer(synthetic(1, seed=119))] == [pb.STATUS_OK]
        before_sum, before_count = latency_totals(gw)
        requests = synthetic(5, seed=120)
        clock = ingest._clock
        monkeypatch.setattr(ingest, "_clock", lambda: clock() - wait_s)  # read that long before its turn
        ingest.on_message(carrier, message(FrameCodec(), requests, INTERACTIVE, "loader", b"\x00L"))
        monkeypatch.setattr(ingest, "_clock", clock)
        assert len(ingest.backlog) == 1
        await wait_for(lambda: latency_totals(gw)[1] >= before_count + 5, what="the five answered")
        total, count = latency_totals(gw)
    assert count - before_count == 5
    assert total - before_sum >= 5 * wait_s
