"""Helpers for tests of code that uses routing (the gateway's, the agent's and routing's own)."""

from __future__ import annotations

from collections.abc import Mapping

from routing.config import RoutingConfig
from routing.types import PoolSignals

IDLE = PoolSignals()
"""A healthy pool with an empty queue and no latency observed yet."""


def pool_signals(
    config: RoutingConfig, overrides: Mapping[str, PoolSignals] | None = None
) -> dict[str, PoolSignals]:
    """Signals for every configured pool: idle and healthy, except where ``overrides`` says otherwise."""
    signals = {pool.name: IDLE for pool in config.pools}
    signals.update(overrides or {})
    return signals
