"""PolicyHolder: the current policy of a running daemon, swapped whole on a config reload."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.config import RoutingConfig, load_routing_config
from routing.policy import TierPolicy


class PolicyHolder:
    """Holds the live :class:`TierPolicy`; a reload that fails validation keeps the old one.

    Readers take ``holder.policy`` once per request (a single attribute read, so a concurrent reload
    is seen either wholly or not at all). The calibrator carries over from policy to policy, so a reload
    does not forget observed latencies.
    """

    __slots__ = ("_policy", "generation")

    def __init__(self, config: RoutingConfig) -> None:
        self._policy = TierPolicy(config)
        self.generation = 0
        """Incremented each time a reload replaces the policy."""

    @property
    def policy(self) -> TierPolicy:
        """The policy in force."""
        return self._policy

    def reload(self, mapping: Mapping[str, Any], *, section: str = "routing") -> bool:
        """Validate ``mapping`` as the routing section and make it the policy in force.

        Returns True when the policy was replaced, False when the new config equals the current one.
        Raises :class:`~routing.config.RoutingConfigError` when it is invalid; the old policy stays.
        """
        return self.apply(load_routing_config(mapping, section=section))

    def apply(self, config: RoutingConfig) -> bool:
        """Make an already validated config the policy in force; False when it equals the current one."""
        if config == self._policy.config:
            return False
        calibrator = self._policy.calibrator
        calibrator.alpha = config.calibration.alpha
        self._policy = TierPolicy(config, calibrator)
        self.generation += 1
        return True
