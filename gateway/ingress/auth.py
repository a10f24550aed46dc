"""CurveZMQ keys and ZAP authentication of agents against a directory of allowed public keys.

Each allowed agent is one ZeroMQ certificate file ``<agent_id>.key`` (as ``hk-gateway keygen --agent``
writes it) whose metadata names the agent id and region. The ZAP handler admits a CURVE client only when
its public key is in the directory and tags the connection with the agent id, which every message then
carries as its ``User-Id`` property: the gateway never trusts the envelope's agent_id on its own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from gateway.ops.metrics import GatewayMetrics

_META = re.compile(r'^\s+([A-Za-z0-9_-]+)\s*=\s*"?([^"]*)"?\s*$')


class KeyFileError(ValueError):
    """A key file that cannot be used (missing, unreadable, or without the metadata the gateway needs)."""


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    agent_id: str
    region: str
    public_key: bytes  # z85


def read_metadata(path: Path) -> dict[str, str]:
    """The ``metadata`` section of a ZeroMQ certificate file (ZPL)."""
    out: dict[str, str] = {}
    section = ""
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            section = line.strip()
            continue
        match = _META.match(line)
        if match and section == "metadata":
            out[match.group(1)] = match.group(2)
    return out


def load_directory(directory: Path) -> dict[bytes, AgentIdentity]:
    """Every ``*.key`` certificate in a directory, keyed by z85 public key."""
    if not directory.is_dir():
        raise KeyFileError(f"{directory}: not a directory")
    agents: dict[bytes, AgentIdentity] = {}
    for path in sorted(directory.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise KeyFileError(f"{path}: {exc}") from exc
        meta = read_metadata(path)
        agent_id = meta.get("agent-id", path.stem)
        if not agent_id:
            raise KeyFileError(f"{path}: empty agent-id")
        agents[public] = AgentIdentity(agent_id, meta.get("region", "unknown"), public)
    return agents


def load_server_keys(path: Path) -> tuple[bytes, bytes]:
    """The gateway's (public, secret) z85 key pair from a ``*.key_secret`` certificate."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: {exc}") from exc
    if secret is None:
        raise KeyFileError(f"{path}: holds no secret key (use the .key_secret file)")
    return public, secret


def write_keypair(directory: Path, name: str, metadata: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """Write ``name.key`` (public, shareable) and ``name.key_secret`` (0600) into ``directory``.

    Both carry the metadata (pyzmq's own writer puts it in the secret file only, and the gateway reads
    the agent id and region from the public one).
    """
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    meta = "".join(f'    {key} = "{value}"\n' for key, value in (metadata or {}).items())
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    head = "#   ZeroMQ CURVE {} Certificate, written by hk-gateway keygen\n\nmetadata\n" + meta + "curve\n"
    public_line = f'    public-key = "{public.decode()}"\n'
    public_path.write_text(head.format("Public") + public_line)
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(head.format("**Secret**") + public_line + f'    secret-key = "{secret.decode()}"\n')
    return public_path, secret_path


class AgentDirectory:
    """The allowed agents by id: what a shard checks the front's ZAP verdict (``User-Id``) against."""

    def __init__(self, agents: dict[bytes, AgentIdentity]) -> None:
        self.replace(agents)

    def replace(self, agents: dict[bytes, AgentIdentity]) -> None:
        """Swap the directory (SIGHUP)."""
        self._by_id = {identity.agent_id: identity for identity in agents.values()}

    def identity(self, agent_id: str) -> AgentIdentity | None:
        return self._by_id.get(agent_id)


class AgentAuthenticator(AsyncioAuthenticator):
    """ZAP handler: admits CURVE clients whose key is in the directory; counts every refusal."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        agents: dict[bytes, AgentIdentity],
        metrics: GatewayMetrics,
        domains: list[str],
    ) -> None:
        super().__init__(context)
        self._agents = agents
        self._by_id = {identity.agent_id: identity for identity in agents.values()}
        self._metrics = metrics
        # pyzmq looks providers up by the socket's ZAP domain (each carrier sets its own name).
        for domain in ["*", *domains]:
            self.configure_curve_callback(domain, credentials_provider=self)

    @property
    def agents(self) -> dict[bytes, AgentIdentity]:
        return self._agents

    def replace(self, agents: dict[bytes, AgentIdentity]) -> None:
        """Swap the directory (SIGHUP); connections already admitted stay."""
        self._agents = agents
        self._by_id = {identity.agent_id: identity for identity in agents.values()}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._agents:
            return True
        self._metrics.auth_rejected.labels("unknown_key").inc()
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        identity = self._agents.get(zmq.utils.z85.encode(client_public_key))
        return identity.agent_id if identity else ""

    def identity(self, agent_id: str) -> AgentIdentity | None:
        return self._by_id.get(agent_id)


def curve_options(public: bytes, secret: bytes) -> dict[int, Any]:
    return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}
