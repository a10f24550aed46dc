"""The shards' processes: started by the front, restarted when they die, stopped on the front's signals.

A shard is ``python -m gateway [--config PATH] shard --index I --shards N --link EP --overrides JSON``:
the same program, config file and command-line overrides as the front. On SIGHUP the front checks the file
first and signals the shards only when it is valid; each shard then reads it again itself (a file changed
again in between is what the shard applies).
A shard that exits while the front is not stopping is started again after a back-off (0.5 s, doubling to
10 s; back to 0.5 s once one ran for a minute). Its agents' frames meanwhile find no shard: the front
counts them, the agents resend what was not acknowledged, and the new incarnation serves it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("gateway.shards")

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
STEADY_S = 60.0


def restart_delay(previous_s: float, ran_s: float) -> float:
    """The back-off before the next start of a shard that ran ``ran_s`` and last waited ``previous_s``."""
    if ran_s >= STEADY_S or previous_s <= 0:
        return FIRST_DELAY_S
    return min(MAX_DELAY_S, previous_s * 2)


def shard_command(
    index: int, count: int, link: str, config_path: Path | None, overrides: Mapping[str, Any]
) -> list[str]:
    config = ["--config", str(config_path)] if config_path is not None else []
    return [
        sys.executable,
        "-m",
        "gateway",
        *config,
        "shard",
        "--index",
        str(index),
        "--shards",
        str(count),
        "--link",
        link,
        "--overrides",
        json.dumps(dict(overrides)),
    ]


def shard_environment() -> dict[str, str]:
    """The front's environment without systemd's notify socket: only the front talks to systemd."""
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    return env


class ShardProcess:
    """One shard's process over its incarnations."""

    def __init__(
        self,
        index: int,
        command: list[str],
        on_exit: Callable[[ShardProcess, int], None],
    ) -> None:
        self.index = index
        self._command = command
        self._on_exit = on_exit
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.incarnation = 0
        self.exits: list[int] = []  # return codes of the incarnations that ended (the last 16)
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._delay = 0.0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None or self.proc.returncode is not None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"shard-{self.index}")

    async def _run(self) -> None:
        while not self._stopping:
            self.proc = await asyncio.create_subprocess_exec(
                *self._command, stdin=asyncio.subprocess.DEVNULL, env=shard_environment()
            )
            self.incarnation += 1
            self.started_at = time.monotonic()
            log.info("shard started", shard=self.index, pid=self.proc.pid, incarnation=self.incarnation)
            code = await self.proc.wait()
            self.exits = [*self.exits[-15:], code]
            ran_s = time.monotonic() - self.started_at
            self._on_exit(self, code)
            if self._stopping:
                return
            self._delay = restart_delay(self._delay, ran_s)
            log.error(
                "shard exited; starting it again",
                shard=self.index,
                code=code,
                ran_s=round(ran_s, 1),
                after_s=self._delay,
            )
            await asyncio.sleep(self._delay)

    def signal(self, sig: signal.Signals) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> None:
        """SIGKILL this incarnation (a shard that stopped reporting); it is started again."""
        self.signal(signal.SIGKILL)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM (the shard drains), wait up to ``timeout_s``, then SIGKILL; no restart after."""
        self._stopping = True
        if self._task is None:
            return
        if not self.alive:  # between incarnations: nothing to drain
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            return
        self.signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout_s)
        except TimeoutError:
            log.error("shard did not stop in time; killing it", shard=self.index, timeout_s=timeout_s)
            self.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._task, 5.0)
        finally:
            if not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
