"""Helpers for agent tests: agent configs pointed at a test gateway, the agent as a real process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from edge_agent.agent import EdgeAgent
from edge_agent.config import AgentConfig, load_config
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.server import Gateway
from gateway.testing import run_gateway, wait_for

NOWHERE = {"hgc": "tcp://127.0.0.1:9"}  # nothing listens: Hong Kong unreachable


def heavy_realtime(n: int, *, model_kind: int = pb.REQUEST_KIND_RANKING) -> list[pb.InferRequest]:
    """``n`` synthetic requests of one kind, without ids, scored for the cloud tier."""
    out = []
    for g in SyntheticTraffic(21, regions=("us-west",)).take(n * 10):
        if g.request.kind == model_kind:
            request = pb.InferRequest()
            request.CopyFrom(g.request)
            request.request_id = b""
            request.complexity_hint = 0.95  # would go to the cloud tier
            out.append(request)
        if len(out) == n:
            break
    return out


def agent_config(endpoints: dict[str, str], models: Path, spool: Path, **extra: Any) -> AgentConfig:
    """An agent for us-west talking to the given carriers, intake on a free loopback port."""
    overrides: dict[str, Any] = {
        "region": "us-west",
        "intake": "tcp://127.0.0.1:*",
        "carriers": [{"name": name, "endpoint": endpoint} for name, endpoint in endpoints.items()],
        "local": {"repository": str(models)},
        "spool": {"directory": str(spool)},
        "uplink": {"ping_interval_s": 0.1, "dead_after_s": 0.6, "ack_timeout_s": 0.8},
        "http": {"port": 0},
    }
    for key, value in extra.items():
        overrides[key] = {**overrides.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(environ={}, overrides=overrides)


@asynccontextmanager
async def agent_on_gateway(
    models: Path, spool: Path, gateway: dict[str, Any] | None = None, **extra: Any
) -> AsyncIterator[tuple[Gateway, EdgeAgent]]:
    """A test gateway (``gateway``: its config overrides) and an in-process agent on all its carriers
    (``extra``: agent config sections), yielded once the agent has a live carrier."""
    async with run_gateway(models_dir=models, **(gateway or {})) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(agent_config(endpoints, models, spool, **extra)) as agent:
            await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
            yield gw, agent


async def spawn_agent(
    config: Path, *args: str, capture: bool = False, new_session: bool = True
) -> asyncio.subprocess.Process:
    """``edge-agent --config CONFIG ARGS...``: its output piped when ``capture``, else discarded; in its own
    process group when ``new_session`` (so a test can kill -9 it whole)."""
    stream = asyncio.subprocess.PIPE if capture else asyncio.subprocess.DEVNULL
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "edge_agent",
        "--config",
        str(config),
        *args,
        stdout=stream,
        stderr=stream,
        start_new_session=new_session,
    )
