"""What a KServe v2 server serves, read from the server itself.

The repository index lists what is loaded, ``ModelConfig`` gives each one's ``config.pbtxt`` (read by the
same code as the embedded backend's repository), ServerReady and ModelReady say what can take calls. A
model whose config enables ``dynamic_batching`` is batched by the server, not the gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from edgewire.extras import optional_dependency
from gateway.backends.kserve.options import KServeOptions
from inference.backends.base import ModelSpec, ServedVersions
from inference.backends.modelrepo import ModelRepositoryError, spec_from_config

with optional_dependency("gateway", "triton"):
    from tritonclient.utils import InferenceServerException

_log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RemoteModel:
    """A model version the server serves: its spec and its dynamic batcher's priority levels (0 = none)."""

    spec: ModelSpec
    priority_levels: int


class ModelCatalog:
    """The served model versions and readiness of one server, as of the last :meth:`refresh`.

    A failed check leaves the server not ready (nothing is served until a check succeeds) and is counted
    in ``failures``; the first one, and each one after a success, is logged.
    """

    def __init__(self, backend: str, options: KServeOptions, kind: str) -> None:
        self.backend = backend
        self.options = options
        self.kind = kind
        self.served: ServedVersions[RemoteModel] = ServedVersions({}, {})
        self.server_ready = False
        self.ready_models: frozenset[tuple[str, str]] = frozenset()
        self.failures = 0

    @property
    def serving(self) -> bool:
        """The server is ready and at least one of its models is."""
        return self.server_ready and bool(self.ready_models)

    async def refresh(self, clients: Sequence[Any], headers: Mapping[str, str] | None) -> None:
        """Check readiness through every client and read models loaded or unloaded since the last check.

        ``clients`` are tritonclient's asyncio gRPC clients (no type information), one per connection.
        """
        client = clients[0]
        timeout = self.options.control_timeout_s
        try:
            # Every connection is asked, so that each one reconnects after a server restart before it is
            # given calls again (gRPC otherwise keeps an idle channel in reconnect backoff).
            answers = await asyncio.gather(
                *(c.is_server_ready(headers=headers, client_timeout=timeout) for c in clients)
            )
            self.server_ready = all(answers)
            if not self.server_ready:
                self.ready_models = frozenset()
                return
            index = await client.get_model_repository_index(headers=headers, client_timeout=timeout)
            listed = {
                (m.name, m.version)
                for m in index.models
                if m.state == "READY"
                and m.version
                and (not self.options.models or m.name in self.options.models)
            }
            if listed != set(self.served.entries):
                self.served = await self._read_models(client, listed, headers)
            ready = await asyncio.gather(
                *(
                    client.is_model_ready(name, version, headers=headers, client_timeout=timeout)
                    for name, version in self.served.entries
                )
            )
            self.ready_models = frozenset(
                key for key, ok in zip(self.served.entries, ready, strict=True) if ok
            )
        except (InferenceServerException, ModelRepositoryError) as exc:
            self.failures += 1
            if self.server_ready or self.failures == 1:  # a change, or never reached since start
                _log.warning(f"{self.kind} server check failed", backend=self.backend, error=str(exc))
            self.server_ready = False
            self.ready_models = frozenset()

    async def _read_models(
        self, client: Any, listed: set[tuple[str, str]], headers: Mapping[str, str] | None
    ) -> ServedVersions[RemoteModel]:
        models: dict[tuple[str, str], RemoteModel] = {}
        for name, version in sorted(listed):
            previous = self.served.entries.get((name, version))
            if previous is not None:
                models[(name, version)] = previous
                continue
            answer = await client.get_model_config(
                name, version, headers=headers, client_timeout=self.options.control_timeout_s
            )
            config = answer.config
            where = Path(f"{self.kind}://{self.options.url}/{name}/config.pbtxt")
            spec = spec_from_config(config, version, where)
            levels = int(config.dynamic_batching.priority_levels) if spec.server_batching else 0
            models[(name, version)] = RemoteModel(spec, levels)
        defaults: dict[str, str] = {}
        for name, version in models:
            pin = self.options.pins.get(name)
            if pin is not None:
                if (name, pin) in models:
                    defaults[name] = pin
                continue  # a pinned version that is not loaded is not served as another one
            if name not in defaults or int(version) > int(defaults[name]):
                defaults[name] = version
        added = sorted(set(models) - set(self.served.entries))
        if added:
            found = [f"{m}/{v}" for m, v in added]
            _log.info(f"{self.kind} models found", backend=self.backend, models=found)
        return ServedVersions(models, defaults)
