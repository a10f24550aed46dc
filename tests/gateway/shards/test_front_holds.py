"""A gateway with ``shards = 2`` as a process, its budget holding a flooder's connection: the shard tells
the front, and the front refuses the held flood itself, reading it at ``held_reads_per_s``, while another
agent on the same carrier and shard is served in between (gateway/shards/holds.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from edgewire import pb
from gateway.ingress.budget import HELD_READS_BURST, TOLD_PER_HOLD
from gateway.testing import WireClient, fresh_requests
from tests.gateway.daemon.test_serving import synthetic
from tests.gateway.shards.test_front import Http, ids_on_shards, running, shards_config, total
from tests.gateway.test_budget import MIB, bomb

HELD_FLOOD = 600  # bombs sent on the flooder's connection once it is held: ~5.7 s of them at 100 a second
# At 256 KiB/s a refused 4 MiB bomb waits ~16 s: the hold outlasts the flood
BUDGET = f"""
[budget]
bytes_per_s = {MIB // 4}
burst_bytes = {8 * MIB}
large_frame_bytes = {4 * MIB}
held_reads_per_s = 100.0
"""


async def over_budget(http: Http) -> float:
    return total(await http.metrics(), "hkgw_frames_rejected_total", carrier="hgc", reason="over_budget")


async def until(http: Http, least: float, timeout_s: float = 30.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (refused := await over_budget(http)) < least:
        assert time.monotonic() < deadline, f"{refused} refused over_budget, waiting for {least}"
        await asyncio.sleep(0.05)
    return refused


async def test_a_held_flood_is_refused_and_paced_by_the_front_and_another_agent_is_served_in_between(
    tmp_path: Path, models_dir: Path
) -> None:
    """The flooder's burst admits two bombs, the shard answers TOLD_PER_HOLD refusals and then holds its
    connection and tells the front; of the 600 bombs that follow, read at 100 a second past a burst (~5.7
    s: a scrape of the front's /metrics, which waits for the shards', and the victim's ONNX call on a busy
    machine take a good part of a second), the victim's request (same carrier, same shard) is answered while
    most are unread. Pauses are
    counted (only the front pauses a carrier's reading in a gateway of shards), and every bomb is refused
    over_budget, none decompressed past the burst."""
    flooder, victim = ids_on_shards(2, "held")[:2]  # both on shard 0
    floods = [bomb(4 * MIB, flooder) for _ in range(2 + TOLD_PER_HOLD + HELD_FLOOD)]
    async with (
        running(shards_config(tmp_path / "gateway.toml", models_dir, BUDGET)) as process,
        aiohttp.ClientSession() as session,
        WireClient(process.endpoint("hgc"), agent_id=flooder) as flood_client,
        WireClient(process.endpoint("hgc"), agent_id=victim) as victim_client,
    ):
        http = Http(process, session)
        await victim_client.ping()  # connected and known before the flood
        for f in floods[: 2 + TOLD_PER_HOLD + 1]:
            await flood_client.send_raw(f)
        await until(http, TOLD_PER_HOLD + 1)  # held: frames sent before its hold reaches the front go to the
        # shard, which refuses them and tells the front again
        for f in floods[2 + TOLD_PER_HOLD + 1 :]:
            await flood_client.send_raw(f)
        await until(http, TOLD_PER_HOLD + 1 + HELD_READS_BURST + 10)
        answers = await asyncio.wait_for(
            victim_client.infer(fresh_requests(synthetic(1, seed=95))), timeout=10
        )
        refused_then = await over_budget(http)
        assert [a.status for a in answers] == [pb.STATUS_OK]
        # The shard holding it says so (the front's copy of the hold is not counted again).
        assert total(await http.metrics(), "hkgw_held_connections") == 1
        assert refused_then < TOLD_PER_HOLD + HELD_FLOOD / 2, refused_then  # the flood paced
        await until(http, TOLD_PER_HOLD + HELD_FLOOD)
        samples = await http.metrics()
        assert (
            total(samples, "hkgw_frames_rejected_total", reason="over_budget") == TOLD_PER_HOLD + HELD_FLOOD
        )
        assert total(samples, "hkgw_frames_rejected_total", reason="payload_invalid") == 2  # the burst's
        assert total(samples, "hkgw_carrier_read_pauses_total", carrier="hgc") >= 10
        assert len(flood_client.acks) <= TOLD_PER_HOLD + 2  # the refusals past the told ones unanswered
