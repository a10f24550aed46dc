"""Errors the agent survives are counted by reason and logged, never swallowed; bad intake frames counted."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from edge_agent.admission import Admission
from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.errors import ErrorReason
from edge_agent.local import LocalTier
from edge_agent.ops import AgentCollector
from edgewire import FrameCodec, pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import NOWHERE, agent_config, heavy_realtime


def exported(agent: EdgeAgent, name: str, label: str = "reason") -> dict[str, float]:
    """One labelled metric of the agent's collector: label value -> value."""
    return {
        sample.labels[label]: sample.value
        for family in AgentCollector(agent).collect()
        for sample in family.samples
        if sample.name == name
    }


async def test_every_error_reason_is_exported_from_the_start(models_dir: Path, tmp_path: Path) -> None:
    """edge_errors_total has every reason at 0 before anything went wrong (alerts need the series)."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        errors = exported(agent, "edge_errors_total")
    assert errors == {str(reason): 0 for reason in ErrorReason}


async def test_a_failing_local_tier_answers_internal_and_is_counted(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local model call that raises answers each of its callers INTERNAL, counts local_tier and logs
    what failed (the model); the next batch is served again."""
    calls: list[int] = []
    real = LocalTier.serve

    async def serve(self: LocalTier, requests: Sequence[pb.InferRequest]) -> list[pb.InferResponse]:
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("injected: model call failed")
        return await real(self, requests)

    monkeypatch.setattr(LocalTier, "serve", serve)
    requests = heavy_realtime(6)
    first, second = requests[:3], requests[3:]
    with capture_logs() as logs:
        async with (
            EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool")) as agent,
            EdgeClient(agent.intake_endpoint) as client,
        ):
            realtime = pb.PRIORITY_CLASS_REALTIME
            failed = await client.infer_many(first, deadline_s=5, priority=realtime)
            served = await client.infer_many(second, deadline_s=5, priority=realtime)
            errors = exported(agent, "edge_errors_total")
    assert [(r.status, r.error_message) for r in failed] == [(pb.STATUS_INTERNAL, "local tier failed")] * 3
    assert {r.status for r in served} == {pb.STATUS_OK}
    assert errors["local_tier"] == 1 and sum(errors.values()) == 1
    [logged] = [e for e in logs if e["event"] == "local tier failed"]
    assert logged["model"] == first[0].model_name and logged["requests"] == 3
    assert logged.get("exc_info") is True  # logged with its traceback


async def test_a_frame_that_fails_to_be_taken_is_counted_and_the_intake_goes_on(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while taking a frame costs that frame (no Ack: its caller times out) and counts take_frame;
    the intake keeps serving the next frame."""
    real = Admission.take
    failures = [1]

    def take(self: Admission, caller: bytes, requests: list[pb.InferRequest]) -> object:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("injected: decision table bug")
        return real(self, caller, requests)

    monkeypatch.setattr(Admission, "take", take)
    requests = heavy_realtime(2)
    async with (
        EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})) as agent,
        EdgeClient(agent.intake_endpoint) as client,
    ):
        realtime = pb.PRIORITY_CLASS_REALTIME
        [lost] = await client.infer_many(requests[:1], deadline_s=0.2, priority=realtime)
        [answered] = await client.infer_many(requests[1:], deadline_s=2, priority=realtime)
        errors = exported(agent, "edge_errors_total")
    assert lost.error_message == "no answer from the edge agent in time"
    assert answered.status == pb.STATUS_DEADLINE_EXCEEDED and "round trip" in answered.error_message
    assert errors["take_frame"] == 1 and sum(errors.values()) == 1


async def test_intake_frames_that_cannot_be_taken_are_counted_by_reason(
    models_dir: Path, tmp_path: Path
) -> None:
    """Garbage and a frame that is not a RequestBatch are refused and counted by reason, not ignored."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(agent.intake_endpoint)
        try:
            await sock.send_multipart([b"not a header", b"not a payload"])
            await sock.send_multipart(FrameCodec().encode(pb.Ping(nonce=1), agent_id="svc"))
            await wait_for(lambda: sum(agent.stats.bad_frames.values()) == 2)
        finally:
            sock.close(0)
            context.term()
        bad = exported(agent, "edge_intake_bad_frames_total")
    assert bad["unexpected_kind"] == 1
    assert sum(bad.values()) == 2
    assert "other" in bad and "frame_too_large" in bad  # every reason present from the start


async def test_parked_answers_and_reattached_requests_are_exported(models_dir: Path, tmp_path: Path) -> None:
    """edge_parked_answers_total has every outcome from the start; a parked answer shows in it and in the
    held gauge (operators see answers waiting for a caller that went away)."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        assert agent.callers is not None
        before = {
            sample.labels.get("outcome", sample.name): sample.value
            for family in AgentCollector(agent).collect()
            if family.name in {"edge_parked_answers", "edge_parked_answers_held", "edge_reattached_requests"}
            for sample in family.samples
        }
        agent.callers.parked.park(b"svc-1", pb.InferResponse(request_id=b"r" * 16, status=pb.STATUS_OK))
        after = exported(agent, "edge_parked_answers_total", label="outcome")
        held = next(
            s.value
            for f in AgentCollector(agent).collect()
            for s in f.samples
            if s.name == "edge_parked_answers_held"
        )
    assert before == {
        "parked": 0,
        "claimed": 0,
        "expired": 0,
        "full": 0,
        "edge_parked_answers_held": 0,
        "edge_reattached_requests_total": 0,
    }
    assert after["parked"] == 1
    assert held == 1


async def test_a_missing_local_repository_is_said_at_start(tmp_path: Path) -> None:
    """local.enabled with a repository path that does not exist: the agent runs without a local tier and
    says so in its log, naming the path (a mistyped path was silent)."""
    missing = tmp_path / "no-such-models"
    with capture_logs() as logs:
        async with EdgeAgent(agent_config(NOWHERE, missing, tmp_path / "spool")) as agent:
            assert agent.local is None
    warned = [e for e in logs if e["event"].startswith("local tier enabled but its model repository")]
    assert [(e["log_level"], e["repository"]) for e in warned] == [("warning", str(missing))]


async def test_carrier_connection_life_and_send_window_are_exported(models_dir: Path, tmp_path: Path) -> None:
    """Operators see each carrier's socket events and up/down changes (every series from start) and the
    send window's size, cuts and restarts, not only the agent's memory."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        uplink = agent.uplink
        assert uplink is not None
        (carrier,) = uplink.carriers.values()
        carrier.came_up += 2
        uplink.window.overloaded(sent_at=1.0, now=2.0)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in AgentCollector(agent).collect()
            for s in f.samples
        }
    name = carrier.name
    events = {k[1][1][1] for k in samples if k[0] == "edge_carrier_connection_events_total"}
    assert events == {"connected", "connect_delayed", "connect_retried", "disconnected"} | {
        "handshake_succeeded",
        "handshake_failed",
    }
    assert samples["edge_carrier_changes_total", (("carrier", name), ("change", "came_up"))] == 2
    assert samples["edge_carrier_changes_total", (("carrier", name), ("change", "went_down"))] == 0
    assert samples["edge_send_window_cuts_total", ()] == 1
    assert samples["edge_send_window", ()] == uplink.window.size
    assert samples["edge_send_window_restarts_total", ()] == uplink.window.restarts
