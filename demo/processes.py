"""The demo's child processes: ``hk-gateway`` and one ``edge-agent --region R`` per region, as production
runs them, each started with JSON logs and known by its ready line; and what they cost in CPU (/proc).

Each child's stderr is read for as long as it runs (a pipe left unread would block it once full): every
line goes to its log file, warnings and errors are counted by event for the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

READY_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
"""SIGTERM to exit: the agent drains for at most 10 s (its DRAIN_TIMEOUT_S), the gateway as configured."""
_CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


@dataclass
class Child:
    """A started child process, its ready line and what it logged."""

    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)
    events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (level, event), warning and up
    records: list[dict[str, Any]] = field(default_factory=list)  # info and up, the last 200
    _reader: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def last(self, event: str) -> dict[str, Any] | None:
        """The last log record named ``event`` (e.g. the agent's "drained")."""
        return next((r for r in reversed(self.records) if r.get("event") == event), None)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then wait for the exit code (SIGKILL after ``timeout_s``) and the rest of its log."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            code = await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader, 5)
        return code


async def start_child(name: str, argv: list[str], ready_event: str, log_path: Path) -> Child:
    """Start ``python -m <argv>`` and return once it logged ``ready_event`` (its fields in ``ready``)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *argv,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    child = Child(name, proc, log_path)
    ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    child._reader = asyncio.create_task(_read_log(child, ready_event, ready), name=f"log-{name}")
    try:
        child.ready = await asyncio.wait_for(ready, READY_TIMEOUT_S)
    except (TimeoutError, RuntimeError) as exc:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        tail = "\n".join(json.dumps(r) for r in child.records[-10:])
        raise SystemExit(f"{name} did not become ready ({exc or 'timeout'}); its log ends:\n{tail}") from None
    return child


async def _read_log(child: Child, ready_event: str, ready: asyncio.Future[dict[str, Any]]) -> None:
    assert child.proc.stderr is not None
    with child.log_path.open("wb") as out:
        while line := await child.proc.stderr.readline():
            out.write(line)
            try:
                record = json.loads(line)
            except ValueError:
                child.events[("text", line.decode(errors="replace").strip()[:120])] += 1
                continue
            if not isinstance(record, dict):
                continue
            level = str(record.get("level", "info"))
            event = str(record.get("event", ""))
            if level in ("warning", "error", "critical"):
                child.events[(level, event)] += 1
            child.records.append(record)
            del child.records[:-200]
            if event == ready_event and not ready.done():
                ready.set_result(record)
    if not ready.done():
        ready.set_exception(RuntimeError(f"exited with {await child.proc.wait()} before it was ready"))


# ---------------------------------------------------------------------- CPU from /proc


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (those that ended included)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every live descendant (the gateway's CPU workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                children.setdefault(int(_stat_fields(entry / "stat")[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError, IndexError):
            total += process_cpu_s(current)
        todo.extend(children.get(current, ()))
    return total


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of a process's live threads, by thread kind (the main thread is the event loop)."""
    out: defaultdict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        out[thread_kind(pid, int(task.name), comm)] += ns / 1e9
    return dict(out)


def thread_kind(pid: int, tid: int, comm: str) -> str:
    """Names threads by what they run in an edge agent (and in the gateway)."""
    if tid == pid:
        return "event loop"
    if comm.startswith("ZMQbg"):
        return "ZeroMQ I/O"
    return "other threads (local tier, spool fsync)"


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU ticks of the whole machine so far, every process counted (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return float(sum(values) - idle), float(sum(values))


def _stat_fields(path: Path) -> list[str]:
    """Fields of a /proc stat file after the command name (which may hold spaces): [state, ppid, ...]."""
    text = path.read_text()
    match = re.match(r"\d+ \(.*\) (.*)", text, re.DOTALL)
    if match is None:
        raise IndexError(path)
    return match.group(1).split()
