"""Run hk-gateway as a real process (as systemd would), with a stand-in notify socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gateway.shards.placement import shard_of

SHARDS = [pytest.param(1, id="shards1"), pytest.param(2, id="shards2")]
"""For ``@pytest.mark.parametrize("shards", SHARDS)``: the single process, and a front with two shards."""


def write_config(
    path: Path,
    models_dir: Path,
    extra: str = "",
    binds: Mapping[str, str] | None = None,
    http_port: int = 0,
    shards: int = 1,
) -> Path:
    """A plaintext test gateway; carriers hgc, pccw, tgt at ``binds`` (default: free loopback ports).
    ``shards`` is written out, 1 included, so that a test never depends on this machine's cores."""
    binds = binds or {}
    carriers = "".join(
        f'[[carriers]]\nname = "{name}"\nbind = "{binds.get(name, "tcp://127.0.0.1:*")}"\n'
        for name in ("hgc", "pccw", "tgt")
    )
    path.write_text(
        f"""
shards = {shards}
instance = "hk-gw-test"
drain_timeout_s = 10.0
drain_grace_s = 1.0
{carriers}[security]
mode = "plaintext"
[http]
port = {http_port}
[health]
interval_s = 0.1
[logging]
format = "json"
[backends.embedded]
type = "onnx"
repository = "{models_dir}"
threads = 2
{extra}
"""
    )
    return path


class InterleavedLogLines(AssertionError):
    """Two processes' log lines came out as one (``{...}{...}``): they share the gateway's stderr."""


def agent_ids(shards: int, base: str = "test-agent") -> list[str]:
    """One agent id per shard, ``ids[i]`` placed on shard ``i`` (``base`` first where it lands), so that
    traffic reaches every shard of a front."""
    ids: dict[int, str] = {}
    for n in range(1000):
        candidate = base if n == 0 else f"{base}-{n}"
        ids.setdefault(shard_of(candidate, shards), candidate)
        if len(ids) == shards:
            return [ids[i] for i in range(shards)]
    raise AssertionError(f"no agent ids for all {shards} shards")


class GatewayProcess:
    """``hk-gateway --config PATH`` in a subprocess; endpoints read from its 'gateway ready' log line."""

    def __init__(self, config: Path, watchdog_usec: int = 200_000) -> None:
        self.config = config
        self.watchdog_usec = watchdog_usec
        self.proc: asyncio.subprocess.Process | None = None
        self.ready: dict[str, Any] = {}
        self.logs: list[dict[str, Any]] = []
        self.interleaved: list[str] = []  # lines that are two JSON records run together
        self.notify_path = config.parent / "notify.sock"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.notify.setblocking(False)
        self.notifications: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        env = {**os.environ, "NOTIFY_SOCKET": str(self.notify_path), "WATCHDOG_USEC": str(self.watchdog_usec)}
        env.pop("WATCHDOG_PID", None)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(self.config),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read_logs())
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if time.monotonic() > deadline or self.proc.returncode is not None:
                if any('"gateway ready"' in line for line in self.interleaved):
                    raise InterleavedLogLines(f"the ready line ran into another: {self.interleaved}")
                raise RuntimeError(f"gateway did not become ready: {self.logs[-5:]}")
            await asyncio.sleep(0.05)

    async def _read_logs(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        async for line in self.proc.stderr:
            try:
                record = json.loads(line)
            except ValueError:
                text = line.decode(errors="replace").strip()
                if text.startswith("{") and "}{" in text:
                    self.interleaved.append(text)
                record = {"event": text}
            self.logs.append(record)
            if record.get("event") == "gateway ready":
                self.ready = record

    def endpoint(self, carrier: str) -> str:
        return str(self.ready["carriers"][carrier])

    @property
    def http_port(self) -> int:
        return int(self.ready["http_port"])

    @property
    def shards(self) -> int:
        """The shards the ready line names (a single-process gateway names none: 1)."""
        return int(self.ready.get("shards", 1))

    def events(self, name: str) -> list[dict[str, Any]]:
        """The log records with this event, from the front and every shard (they share its stderr)."""
        return [r for r in self.logs if r.get("event") == name]

    def reloaded_everywhere(self) -> bool:
        """A "reloaded" line from the process itself (the front) and, with shards, from every shard.
        Raises InterleavedLogLines while one is missing and a "reloaded" line ran into another line."""
        lines = self.events("reloaded")
        shards = {r["shard"] for r in lines if "shard" in r}
        if any("shard" not in r for r in lines) and (self.shards == 1 or shards == set(range(self.shards))):
            return True
        garbled = [line for line in self.interleaved if '"reloaded"' in line]
        if garbled:
            raise InterleavedLogLines(f"{len(garbled)} lines ran together: {garbled[:2]}")
        return False

    def read_notifications(self) -> list[str]:
        while True:
            try:
                self.notifications.append(self.notify.recv(4096).decode())
            except BlockingIOError:
                return self.notifications

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill_group(self) -> None:
        """kill -9 the gateway with its CPU workers, as systemd's KillMode=control-group does."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)

    async def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 5)
        return code

    async def stop(self) -> None:
        """Kill the gateway's whole process group (its CPU workers too) and stop reading its log."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.notify.close()
