"""CurveZMQ with ZAP: allowed agents are served; unknown keys and plaintext clients are refused, counted."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq.auth

from edgewire import pb
from gateway.ingress.auth import load_directory, write_keypair
from gateway.server import Gateway
from gateway.testing import WireClient, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A gateway key pair, one allowed agent, one stranger."""
    _, server_secret = write_keypair(tmp_path / "server", "gateway")
    agent_public, agent_secret = write_keypair(
        tmp_path / "agent", "edge-us-west-1", {"agent-id": "edge-us-west-1", "region": "us-west"}
    )
    _, stranger_secret = write_keypair(tmp_path / "stranger", "edge-mallory", {"agent-id": "edge-mallory"})
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(agent_public, authorized / agent_public.name)
    return {
        "server": server_secret,
        "agent": agent_secret,
        "stranger": stranger_secret,
        "authorized": authorized,
    }


@pytest.fixture
async def curve_gateway(models_dir: Path, keys: dict[str, Path]) -> AsyncIterator[Gateway]:
    security = {
        "mode": "curve",
        "server_secret_key": str(keys["server"]),
        "authorized_agents": str(keys["authorized"]),
    }
    async with run_gateway(models_dir=models_dir, security=security) as gw:
        yield gw


def curve_of(secret_file: Path, server_secret: Path) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(secret_file)
    server_public, _ = zmq.auth.load_certificate(server_secret)
    assert secret is not None
    return public, secret, server_public


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_allowed_agent_is_served_with_its_key_region(
    curve_gateway: Gateway, keys: dict[str, Path]
) -> None:
    """An agent whose key is in the directory is served; its region comes from its key, not its envelope."""
    curve = curve_of(keys["agent"], keys["server"])
    async with WireClient(
        curve_gateway.endpoint("hgc"), agent_id="edge-us-west-1", region="eu-west", curve=curve
    ) as agent:
        responses = await agent.infer(synthetic(5, seed=41, kind=pb.REQUEST_KIND_TEXT))
    assert all(r.status == pb.STATUS_OK for r in responses)
    counted = sum(
        sample(curve_gateway, "hkgw_requests_total", region="us-west", model="text-encoder", priority=p)
        for p in ("realtime", "interactive", "batch")
    )
    assert counted == 5


async def test_envelope_claiming_another_agent_is_refused(
    curve_gateway: Gateway, keys: dict[str, Path]
) -> None:
    """A valid key whose envelope names another agent gets a frame_reject, not service."""
    curve = curve_of(keys["agent"], keys["server"])
    async with WireClient(curve_gateway.endpoint("pccw"), agent_id="edge-us-east-9", curve=curve) as agent:
        ack = await agent.wait_ack(await agent.send(synthetic(2, seed=42)))
    assert ack.frame_reject == pb.REJECT_REASON_AGENT_MISMATCH
    assert sample(curve_gateway, "hkgw_frames_rejected_total", carrier="pccw", reason="agent_mismatch") == 1


async def test_unknown_key_is_rejected_and_counted(curve_gateway: Gateway, keys: dict[str, Path]) -> None:
    """A CURVE client whose key is not in the directory never gets through ZAP; the refusal is counted."""
    curve = curve_of(keys["stranger"], keys["server"])
    async with WireClient(curve_gateway.endpoint("hgc"), agent_id="edge-mallory", curve=curve) as agent:
        await agent.send(synthetic(1, seed=43))
        await wait_for(lambda: sample(curve_gateway, "hkgw_auth_rejected_total", reason="unknown_key") >= 1)
        assert not await agent.receive_one(0.5)
    assert sample(curve_gateway, "hkgw_frames_received_total", carrier="hgc", kind="request_batch") == 0


async def test_plaintext_client_is_rejected_and_counted(curve_gateway: Gateway) -> None:
    """A client without CURVE fails the handshake; the carrier counts it and serves nothing."""
    async with WireClient(curve_gateway.endpoint("tgt"), agent_id="edge-us-west-1") as agent:
        # Once libzmq has dropped the refused connection there is no pipe to queue into: the send may wait
        # for a connection that never comes (it did whenever the refusal came first).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(agent.send(synthetic(1, seed=44)), timeout=2.0)
        await wait_for(
            lambda: (
                sum(
                    sample(curve_gateway, "hkgw_handshake_failures_total", carrier="tgt", reason=r)
                    for r in ("protocol", "no_detail", "auth")
                )
                >= 1
            )
        )
        assert not await agent.receive_one(0.5)


def test_directory_maps_keys_to_agent_and_region(keys: dict[str, Path]) -> None:
    """The authorized directory yields agent id and region from each certificate's metadata."""
    (identity,) = load_directory(keys["authorized"]).values()
    assert (identity.agent_id, identity.region) == ("edge-us-west-1", "us-west")


def test_secret_key_files_are_private(keys: dict[str, Path]) -> None:
    """keygen writes secret keys readable by the owner only."""
    assert keys["agent"].stat().st_mode & 0o077 == 0


async def test_missing_server_key_is_a_start_error(models_dir: Path, tmp_path: Path) -> None:
    """A curve config whose key file is missing fails start with a GatewayStartError naming security."""
    from gateway.server import GatewayStartError

    security = {
        "mode": "curve",
        "server_secret_key": str(tmp_path / "nope.key_secret"),
        "authorized_agents": str(tmp_path),
    }
    with pytest.raises(GatewayStartError, match="security"):
        async with run_gateway(models_dir=models_dir, security=security):
            pass
