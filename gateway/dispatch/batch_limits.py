"""Pools configured to batch more requests than one of their models takes: said at start and by check-config.

Not an error: a pool cuts each model's batches at the model's own limit (``pool.batch_limit``), so the
configured size is never reached for that model. The gateway logs these lines once at start (for an
operator who never ran ``hk-gateway check-config``) and check-config prints them.
"""

from __future__ import annotations

from pathlib import Path

from gateway.config import DEFAULT_MODELS_DIR, GatewayConfig
from gateway.dispatch.pool import batch_limit
from inference.backends.modelrepo import (
    CONFIG_FILENAME,
    ModelRepositoryError,
    load_model_config,
    spec_from_config,
)
from inference.models.demo import DEMO_MODELS, demo_config


def batch_limit_warnings(config: GatewayConfig) -> list[str]:
    """A line for each pool batching more requests than one of its models takes (Triton's
    ``max_batch_size`` in the model's config.pbtxt, read from backends with a local ``repository``).
    Remote backends' models are not read here."""
    routing_pools = {pool.name: pool for pool in config.routing.pools}
    warnings: list[str] = []
    for name, dispatch in sorted(config.pools.items()):
        repository = config.backends.get(dispatch.backend, {}).get("repository")
        routed = routing_pools.get(name)
        if not isinstance(repository, str) or routed is None or not dispatch.batching:
            continue
        for model in routed.models:
            path = Path(repository) / model / CONFIG_FILENAME
            try:
                if path.is_file():
                    model_config = load_model_config(path)
                elif repository == DEFAULT_MODELS_DIR and model in DEMO_MODELS:
                    model_config = demo_config(model)  # written there on the first run
                else:
                    continue
                spec = spec_from_config(model_config, "", path)
            except ModelRepositoryError as exc:
                warnings.append(f"pools.{name}: cannot read model {model}: {exc}")
                continue
            limit = batch_limit(dispatch.max_batch_size, spec)
            if spec.server_batching or limit >= dispatch.max_batch_size:
                continue
            if spec.max_batch_size <= 0:
                why = f"model {model} does not batch (max_batch_size 0 in {path})"
            else:
                why = f"model {model} takes at most {spec.max_batch_size} ({path})"
            warnings.append(
                f"pools.{name}.max_batch_size: {dispatch.max_batch_size}, but {why}; "
                f"its batches are cut at {limit}"
            )
    return warnings
