"""Test helpers shipped with the product: a real gateway on loopback, and a DEALER agent client.

async with run_gateway() as gw:
    async with WireClient(gw.endpoint("hgc")) as agent:
        responses = await agent.infer(requests)
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from edgewire import FrameCodec, new_id, now_unix_us, pb
from gateway.config import GatewayConfig, load_config
from gateway.server import Gateway
from inference.backends.base import (
    Backend,
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelSpec,
    create,
    register,
)
from routing.config import DEFAULT_ROUTING_SECTION
from service.configfile import merge_tables


class FaultInjectingBackend:
    """Wraps a real backend and injects faults on demand: failures, slowness, refusal to serve.

    Config: ``{type = "fault-injecting", inner = {type = "onnx", ...}}``. Tests flip ``fail``, ``delay_s``
    or ``healthy`` on the live object (``gateway.backends[name]``) and read ``calls``; a ``gate`` (an
    ``asyncio.Event``) holds every call until the test sets it, so a test decides when calls finish instead
    of racing a delay against the machine's speed; ``inputs`` set to a list keeps a copy of every call's
    inputs, in the order the calls came (a test reads which requests a batch held; a copy, because a batch
    prepared in a CPU worker is read from a shared-memory slot that the next batch reuses and that is gone
    once the gateway stops).
    """

    def __init__(self, name: str, inner: Backend) -> None:
        self.name = name
        self.inner = inner
        self.fail = False
        self.overloaded = False
        self.delay_s = 0.0
        self.gate: asyncio.Event | None = None
        self.healthy = True
        self.calls = 0
        self.rows = 0
        self.inputs: list[Mapping[str, np.ndarray]] | None = None

    async def start(self) -> None:
        await self.inner.start()

    async def infer(self, call: InferCall) -> InferResult:
        self.calls += 1
        self.rows += len(next(iter(call.inputs.values()))) if call.inputs else 0
        if self.inputs is not None:
            self.inputs.append({name: np.array(value) for name, value in call.inputs.items()})
        if self.gate is not None:
            await self.gate.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.overloaded:
            raise BackendError("injected: queue full", retryable=True, overloaded=True, status="OVERLOADED")
        if self.fail:
            raise BackendError("injected: backend unavailable", retryable=True, status="UNAVAILABLE")
        return await self.inner.infer(call)

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        return self.inner.model(name, version)

    def health(self) -> BackendHealth:
        return self.inner.health() if self.healthy else BackendHealth.NOT_SERVING

    async def aclose(self) -> None:
        await self.inner.aclose()


@register("fault-injecting")
def _create_fault_injecting(name: str, options: Mapping[str, Any]) -> Backend:
    inner = dict(options.get("inner") or {})
    if not isinstance(inner.get("type"), str):
        raise ValueError("fault-injecting backend needs an 'inner' table with a 'type'")
    return FaultInjectingBackend(name, create(inner.pop("type"), name, inner))


def fault_injecting_pools(inner: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
    """Config overrides: the CPU pool on one fault-injecting wrapper of ``inner`` (``embedded``), every
    cloud pool on another (``gpu``), the default routing; ``extra`` sections merged on top. Tests then
    flip faults on ``gateway.backends["embedded" | "gpu"]``."""
    return {
        "backends": {
            "embedded": {"type": "fault-injecting", "inner": dict(inner)},
            "gpu": {"type": "fault-injecting", "inner": dict(inner)},
        },
        "pools": {
            "cpu": {"backend": "embedded"},
            "gpu-a100-mig": {"backend": "gpu"},
            "gpu-a100": {"backend": "gpu"},
            "gpu-v100": {"backend": "gpu"},
        },
        "routing": copy.deepcopy(DEFAULT_ROUTING_SECTION),
        **extra,
    }


def loopback_overrides(models_dir: Path, **extra: Any) -> dict[str, Any]:
    """Config overrides for a test gateway: free loopback ports, the given model repository."""
    overrides: dict[str, Any] = {
        "carriers": [
            {"name": "hgc", "bind": "tcp://127.0.0.1:*"},
            {"name": "pccw", "bind": "tcp://127.0.0.1:*"},
            {"name": "tgt", "bind": "tcp://127.0.0.1:*"},
        ],
        "http": {"host": "127.0.0.1", "port": 0},
        "security": {"mode": "plaintext"},
        "backends": {"embedded": {"type": "onnx", "repository": str(models_dir), "threads": 2}},
        "health": {"interval_s": 0.1, "rise": 2, "fall": 2},
        "drain_timeout_s": 5.0,
        "drain_grace_s": 0.0,
        "logging": {"format": "json", "level": "warning"},
    }
    return merge_tables(overrides, extra)


@contextlib.asynccontextmanager
async def run_gateway(
    config: GatewayConfig | None = None, *, models_dir: Path | None = None, **overrides: Any
) -> AsyncIterator[Gateway]:
    """Start a real gateway on loopback (free ports) and tear it down afterwards."""
    if config is None:
        if models_dir is None:
            raise ValueError("pass a config or a models_dir")
        config = load_config(environ={}, overrides=loopback_overrides(models_dir, **overrides))
    gateway = Gateway(config)
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.drain()
        await gateway.aclose()


class WireClient:
    """A minimal agent: one DEALER, the shared codec, acks and responses collected by request id."""

    def __init__(
        self,
        endpoint: str,
        *,
        agent_id: str = "test-agent",
        region: str = "us-west",
        curve: tuple[bytes, bytes, bytes] | None = None,  # (client public, client secret, server public)
        context: zmq.asyncio.Context | None = None,
        features: int = 0,  # Envelope.features of its request frames (pb.FEATURE_ACKS_IN_RESPONSES)
    ) -> None:
        self.endpoint = endpoint
        self.agent_id = agent_id
        self.features = features
        self.region = region
        self.codec = FrameCodec()
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            public, secret, server = curve
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = (
                public,
                secret,
                server,
            )
        self.acks: dict[bytes, pb.Ack] = {}
        self.responses: dict[bytes, pb.InferResponse] = {}
        self.duplicate_responses = 0
        self.other: list[tuple[pb.Envelope, Any]] = []
        self.frames_received: Counter[str] = Counter()  # by kind: "ack", "responses", "responses+acks", ...

    async def __aenter__(self) -> WireClient:
        self.sock.connect(self.endpoint)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    async def send(
        self,
        requests: Sequence[pb.InferRequest],
        *,
        message_id: bytes | None = None,
        priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_INTERACTIVE,
    ) -> bytes:
        """Send one RequestBatch frame; returns its message id."""
        message_id = message_id or new_id()
        frames = self.codec.encode(
            pb.RequestBatch(requests=list(requests)),
            agent_id=self.agent_id,
            region=self.region,
            priority=priority,
            message_id=message_id,
            features=self.features,
        )
        await self.sock.send_multipart(frames)
        return message_id

    async def send_raw(self, frames: Sequence[bytes]) -> None:
        await self.sock.send_multipart(list(frames))

    async def ping(self, timeout_s: float = 5.0) -> pb.Pong:
        frames = self.codec.encode(pb.Ping(nonce=7), agent_id=self.agent_id, region=self.region)
        await self.sock.send_multipart(frames)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.receive_one(deadline - time.monotonic())
            for envelope, payload in self.other:
                if isinstance(payload, pb.Pong):
                    self.other.remove((envelope, payload))
                    return payload
        raise TimeoutError("no pong")

    async def receive_one(self, timeout_s: float) -> bool:
        """Read one frame (ack, responses or other) within the timeout; False on timeout."""
        if not await self.sock.poll(max(1, int(timeout_s * 1000))):
            return False
        decoded = self.codec.decode(await self.sock.recv_multipart())
        payload = decoded.payload
        if isinstance(payload, pb.Ack):
            self.frames_received["ack"] += 1
            self.acks[payload.acked_message_id] = payload
        elif isinstance(payload, pb.ResponseBatch):
            parts = [name for name, n in (("responses", payload.responses), ("acks", payload.acks)) if n]
            self.frames_received["+".join(parts) or "empty"] += 1
            for ack in payload.acks:
                self.acks[ack.acked_message_id] = ack
            for response in payload.responses:
                if response.request_id in self.responses:
                    self.duplicate_responses += 1
                else:
                    self.responses[response.request_id] = response
        else:
            self.other.append((decoded.envelope, payload))
        return True

    async def wait_ack(self, message_id: bytes, timeout_s: float = 10.0) -> pb.Ack:
        deadline = time.monotonic() + timeout_s
        while message_id not in self.acks:
            if time.monotonic() > deadline or not await self.receive_one(deadline - time.monotonic()):
                raise TimeoutError(f"no ack for {message_id.hex()}")
        return self.acks[message_id]

    async def wait_responses(
        self, request_ids: Sequence[bytes], timeout_s: float = 20.0
    ) -> list[pb.InferResponse]:
        deadline = time.monotonic() + timeout_s
        missing = [r for r in request_ids if r not in self.responses]
        while missing:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(missing)} of {len(request_ids)} responses missing")
            await self.receive_one(deadline - time.monotonic())
            missing = [r for r in missing if r not in self.responses]
        return [self.responses[r] for r in request_ids]

    async def infer(
        self, requests: Sequence[pb.InferRequest], timeout_s: float = 20.0
    ) -> list[pb.InferResponse]:
        """Send, wait for the ack and every response."""
        message_id = await self.send(requests)
        await self.wait_ack(message_id, timeout_s)
        return await self.wait_responses([r.request_id for r in requests], timeout_s)


def fresh_requests(requests: Sequence[pb.InferRequest], budget_s: float = 5.0) -> list[pb.InferRequest]:
    """Copies of (synthetic) requests with new ids and deadlines from now."""
    out = []
    for request in requests:
        copy = pb.InferRequest()
        copy.CopyFrom(request)
        copy.request_id = new_id()
        copy.deadline_unix_us = now_unix_us() + int(budget_s * 1e6)
        out.append(copy)
    return out


async def wait_for(
    predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "condition"
) -> float:
    """Poll a condition with a deadline (no bare sleeps as synchronisation); the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(interval_s)
    return time.monotonic() - start
