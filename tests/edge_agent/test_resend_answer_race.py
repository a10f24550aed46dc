"""A caller's resend that reaches the agent in the same loop tick as Hong Kong's answer to it: re-attached
(the answer goes at the tick's flush, after the frame's Ack), not refused as an id already used. Seen once in
tests/edge_agent/test_restart.py under the full suite's load: 599 OK and one "request id already used"."""

from __future__ import annotations

import asyncio
from pathlib import Path

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edgewire import new_id, pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_config
from tests.edge_agent.test_uplink import batch_request, never, scripted_carriers

CALLER = "search.host-1"


async def test_a_resend_meeting_its_answer_in_one_tick_is_reattached_and_answered_once(
    models_dir: Path, tmp_path: Path
) -> None:
    async with scripted_carriers((never, 0)) as (carrier,):
        config = agent_config(
            {"a": carrier.endpoint}, models_dir, tmp_path / "spool", local={"enabled": False}
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint, caller_id=CALLER) as client:
            uplink, admission, callers = agent.uplink, agent.admission, agent.callers
            assert uplink is not None and admission is not None and callers is not None
            await wait_for(lambda: uplink.best() is not None)
            request = batch_request()
            request.request_id = new_id()
            asking = asyncio.create_task(client.infer(request, deadline_s=60))
            await wait_for(lambda: carrier.received == [request.request_id], what="sent to Hong Kong")
            await wait_for(lambda: request.request_id in client.accepted, what="acked to the caller")
            # In one tick, no await between: Hong Kong's answer comes in, then the caller's resend is read.
            callers.from_hong_kong(
                pb.InferResponse(request_id=request.request_id, status=pb.STATUS_OK, model_name="rank-mlp")
            )
            resend = pb.InferRequest()
            resend.CopyFrom(request)
            assert admission.take(CALLER.encode(), [resend]) is None  # nothing to spool: re-attached
            answer = await asyncio.wait_for(asking, timeout=10)
    assert answer.status == pb.STATUS_OK, answer.error_message  # without the fix: the nack's, first
    assert admission.reattached == 1
