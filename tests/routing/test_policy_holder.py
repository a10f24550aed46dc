"""PolicyHolder: reloads swap the policy whole, and a reload that fails validation keeps the old one."""

from __future__ import annotations

import pytest

from routing import PolicyHolder, RoutingConfigError, default_routing_config
from routing.config import DEFAULT_ROUTING_SECTION

LOWER = {**DEFAULT_ROUTING_SECTION, "thresholds": {"edge_server": 0.2, "cloud": 0.6}}


def test_reload_replaces_policy() -> None:
    """A valid, different config becomes the policy in force."""
    holder = PolicyHolder(default_routing_config())
    assert holder.reload(LOWER) is True
    assert holder.policy.config.thresholds.cloud == 0.6 and holder.generation == 1


def test_reload_of_same_config_is_a_no_op() -> None:
    """Reloading an equal config keeps the policy object and returns False."""
    holder = PolicyHolder(default_routing_config())
    before = holder.policy
    assert holder.reload(DEFAULT_ROUTING_SECTION) is False
    assert holder.policy is before and holder.generation == 0


def test_failed_reload_keeps_old_policy() -> None:
    """An invalid config raises RoutingConfigError naming the key and leaves the old policy in force."""
    holder = PolicyHolder(default_routing_config())
    before = holder.policy
    with pytest.raises(RoutingConfigError, match=r"^routing\.thresholds\.cloud: "):
        holder.reload({**DEFAULT_ROUTING_SECTION, "thresholds": {"cloud": "high"}})
    assert holder.policy is before and holder.generation == 0


def test_reload_keeps_calibration() -> None:
    """Observed latencies survive a reload, and the new EWMA alpha applies to them."""
    holder = PolicyHolder(default_routing_config())
    holder.policy.calibrator.observe("rank-mlp", 12, 0.05)
    holder.reload({**LOWER, "calibration": {"alpha": 0.5}})
    assert holder.policy.calibrator.estimate("rank-mlp", 12) is not None
    assert holder.policy.calibrator.alpha == 0.5
