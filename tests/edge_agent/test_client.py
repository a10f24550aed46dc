"""EdgeClient's caller id: what it may be, its default, and that the agent spools it with each request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient, SyncEdgeClient, default_caller_id
from edgewire import FrameCodec, new_id, pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import NOWHERE, agent_config, heavy_realtime


@pytest.mark.parametrize("bad", ["", "has space", "x" * 129, "\x00zero", "naïve"])
def test_a_caller_id_that_cannot_be_a_routing_id_is_refused(bad: str) -> None:
    """Empty, too long, or outside the allowed characters: refused at construction, naming the rule."""
    with pytest.raises(ValueError, match="caller_id must match"):
        EdgeClient("tcp://127.0.0.1:9", caller_id=bad)


async def test_default_caller_ids_name_the_service_and_differ_per_client() -> None:
    """The default starts with the service and is new for every client (two never share answers)."""
    first, second = default_caller_id("search api"), default_caller_id("search api")
    assert first.startswith("search-api.") and first != second
    async with EdgeClient("tcp://127.0.0.1:9", service="ads") as client:
        assert client.caller_id.startswith("ads.")


async def test_the_sync_client_caller_id_is_spooled_with_its_request(
    models_dir: Path, tmp_path: Path
) -> None:
    """SyncEdgeClient(caller_id=...) reaches the agent as that caller: the spool names it with the
    request, and the agent's own answer (Hong Kong unreachable: DEADLINE_EXCEEDED) comes back to it."""
    config = agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    (request,) = heavy_realtime(1)
    request.request_id = new_id()
    request.priority = pb.PRIORITY_CLASS_BATCH
    async with EdgeAgent(config) as agent:
        spool = agent.spool
        assert spool is not None

        def call() -> pb.InferResponse:
            with SyncEdgeClient(agent.intake_endpoint, caller_id="billing.host-2") as client:
                return client.infer(request, deadline_s=1.0)

        answer = asyncio.create_task(asyncio.to_thread(call))
        await wait_for(lambda: spool.live_records == 1, what="the request spooled")
        callers = [r.caller for r in spool.records()]
        response = await answer
    assert callers == [b"billing.host-2"]
    assert response.status == pb.STATUS_DEADLINE_EXCEEDED
    assert response.error_message == "deadline passed before an answer from Hong Kong"  # the agent's


@pytest.mark.parametrize(("compress", "codec"), [(False, pb.CODEC_NONE), (True, pb.CODEC_ZSTD)])
async def test_intake_frames_go_uncompressed_unless_asked(compress: bool, codec: int) -> None:
    """The intake is a local hop: by default the client's frames carry the requests as they are (as the
    agent's answers do); ``compress=True`` zstd-compresses them for a caller on a slow link. Either way
    the frame decodes to the same requests."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    requests = heavy_realtime(20)
    try:
        async with EdgeClient(f"tcp://127.0.0.1:{port}", compress=compress) as client:
            call = asyncio.create_task(client.infer_many(requests, deadline_s=5))
            caller, *frames = await asyncio.wait_for(router.recv_multipart(), 10)
            call.cancel()
        envelope = pb.Envelope.FromString(frames[0])
        batch = FrameCodec().decode(frames).payload
    finally:
        router.close(0)
        ctx.term()
    assert caller == client.caller_id.encode()
    assert envelope.codec == codec
    assert isinstance(batch, pb.RequestBatch)
    assert [r.request_id for r in batch.requests] == [r.request_id for r in requests]
