"""The shipped example agent config stays valid."""

from __future__ import annotations

from pathlib import Path

from edge_agent.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_example_config_validates() -> None:
    """deploy/edge-agent.example.toml loads as a us-west agent that discovers carriers by SRV."""
    config = load_config(REPO / "deploy" / "edge-agent.example.toml", environ={})
    assert config.region == "us-west"
    assert config.discovery.mode == "srv"
