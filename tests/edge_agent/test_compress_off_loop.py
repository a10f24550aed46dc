"""Large request frames compressed on the uplink's own thread (``batching.compress_off_loop_bytes``): every
request still answered once against a real gateway; a request that expires while its frame is compressed is
not sent and the rest go in the next frame; a sender cancelled meanwhile puts its requests back."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.uplink.link import Uplink
from edgewire import new_id, now_unix_us, pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_config, agent_on_gateway
from tests.edge_agent.test_uplink import ScriptedCarrier, batch_request, ok, scripted_carriers
from tests.gateway.daemon.test_serving import synthetic


async def test_large_frames_are_compressed_off_the_loop_and_every_request_answered_once(
    models_dir: Path, tmp_path: Path
) -> None:
    """300 ranking requests through an agent whose every frame of 1 KiB or more is compressed on its
    thread: all answered OK by a real gateway, once each; with the setting at 0 none is."""
    for threshold, off_loop in ((1024, True), (0, False)):
        requests = [r for r in synthetic(600, seed=71) if r.kind == pb.REQUEST_KIND_RANKING][:300]
        for r in requests:
            r.priority = pb.PRIORITY_CLASS_BATCH
        async with (
            agent_on_gateway(
                models_dir,
                tmp_path / f"spool-{threshold}",
                local={"enabled": False},
                batching={"compress_off_loop_bytes": threshold},
            ) as (_gw, agent),
            EdgeClient(agent.intake_endpoint) as client,
        ):
            uplink = agent.uplink
            assert uplink is not None
            answers = await asyncio.gather(
                *(client.infer_many(requests[i : i + 50], deadline_s=60) for i in range(0, 300, 50))
            )
            got = [a for chunk in answers for a in chunk]
            assert [a.status for a in got] == [pb.STATUS_OK] * 300
            assert sorted(a.request_id for a in got) == sorted(r.request_id for r in requests)
            assert client.dropped_answers == 0
            assert uplink.stats.sent_requests == 300  # none sent twice
            if off_loop:
                assert uplink.stats.compressed_off_loop == uplink.stats.sent_frames > 0
            else:
                assert uplink.stats.compressed_off_loop == 0 and uplink.stats.sent_frames > 0


@dataclass
class HeldAgent:
    """An agent on one scripted carrier (answers every request OK) whose every frame is compressed off the
    loop, the uplink's thread waiting before each compression until ``release`` is set (at most 10 s);
    ``started`` is set once it waits."""

    carrier: ScriptedCarrier
    client: EdgeClient
    uplink: Uplink
    started: threading.Event
    release: threading.Event


@asynccontextmanager
async def held_agent(models_dir: Path, tmp_path: Path) -> AsyncIterator[HeldAgent]:
    async with scripted_carriers((ok, 0)) as (carrier,):
        config = agent_config(
            {"a": carrier.endpoint},
            models_dir,
            tmp_path / "spool",
            local={"enabled": False},
            batching={"compress_off_loop_bytes": 1},
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            codec = uplink._off_loop_codec
            encode: Callable[..., list[bytes]] = codec.encode
            started, release = threading.Event(), threading.Event()

            def held(*args: Any, **kwargs: Any) -> list[bytes]:
                started.set()
                release.wait(10)
                return encode(*args, **kwargs)

            codec.encode = held  # type: ignore[method-assign]
            yield HeldAgent(carrier, client, uplink, started, release)


async def test_a_request_that_expires_while_its_frame_is_compressed_is_not_sent_and_the_rest_go_next(
    models_dir: Path, tmp_path: Path
) -> None:
    async with held_agent(models_dir, tmp_path) as h:
        short, long = batch_request(), batch_request()
        short.request_id, long.request_id = new_id(), new_id()
        short.deadline_unix_us = now_unix_us() + 1_000_000
        long.deadline_unix_us = now_unix_us() + 60_000_000
        asking = asyncio.create_task(h.client.infer_many([short, long]))
        await asyncio.to_thread(h.started.wait, 10)
        await wait_for(lambda: short.request_id not in h.uplink.outstanding, timeout_s=10, what="expired")
        h.release.set()
        answers = {a.request_id: a for a in await asyncio.wait_for(asking, timeout=15)}
    assert answers[short.request_id].status == pb.STATUS_DEADLINE_EXCEEDED
    assert answers[long.request_id].status == pb.STATUS_OK
    assert h.carrier.received == [long.request_id]  # the first frame was not sent; the second held the rest
    assert h.uplink.stats.compressed_off_loop == 2


async def test_a_sender_cancelled_while_a_frame_is_compressed_puts_its_requests_back(
    models_dir: Path, tmp_path: Path
) -> None:
    async with held_agent(models_dir, tmp_path) as h:
        asking = asyncio.create_task(h.client.infer_many([batch_request(), batch_request()], deadline_s=60))
        await asyncio.to_thread(h.started.wait, 10)
        sender = h.uplink._tasks[0]
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        h.release.set()
        assert len(h.uplink._queue) == 2  # back in the queue, to go once a sender runs again
        assert h.carrier.received == []
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
