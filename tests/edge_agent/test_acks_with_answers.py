"""The reference agent asks for Acks with the answers (FEATURE_ACKS_IN_RESPONSES) and reads them there."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.testing import run_gateway, wait_for
from tests.edge_agent.conftest import agent_config


async def test_agent_reads_acks_that_ride_with_answers(models_dir: Path, tmp_path: Path) -> None:
    """Against a gateway that holds Acks for answers, every frame the agent sent is acknowledged (no Ack
    still due) once its answers are in, and nothing is resent for want of an Ack."""
    hold = {"replies": {"ack_hold_us": 100_000}}
    async with run_gateway(models_dir=models_dir, **hold) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        config = agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        async with EdgeAgent(config) as agent:
            await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
            uplink = agent.uplink
            assert uplink is not None
            requests = [r.request for r in SyntheticTraffic(7, regions=("us-west",)).take(30)]
            for r in requests:
                r.request_id = b""
                r.priority = pb.PRIORITY_CLASS_INTERACTIVE  # no realtime round-trip rule to meet
            async with EdgeClient(agent.intake_endpoint) as client:
                for request in requests:  # one at a time: each its own frame, answered within the hold
                    [response] = await client.infer_many([request], deadline_s=5.0)
                    assert response.status == pb.STATUS_OK, response.error_message
            acks_due = uplink.outstanding.next_ack_due()
            resent = Counter(uplink.stats.resent)
            sent_frames = uplink.stats.sent_frames
    assert sent_frames >= len(requests)
    assert acks_due is None
    assert resent["ack_timeout"] == 0
