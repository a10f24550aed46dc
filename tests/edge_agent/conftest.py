"""Fixtures for agent tests: the demo models, and agent configs pointed at a test gateway."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edge_agent.config import AgentConfig, load_config


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
