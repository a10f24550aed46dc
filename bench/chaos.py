"""Bounded chaos runs (issue 23): how long the edge agent and the gateway take to recover from faults.

    python -m bench.chaos [--scenario NAME ...] [--rounds 3] [--rate 200] [--write]

Each scenario is one function (``SCENARIOS``) that starts what it needs, injects its fault ``rounds``
times under open-loop traffic, and returns a ``Section`` of figures: a table row per round and a summary.
Everything runs on loopback: a real ``hk-gateway`` process (``python -m gateway``) and an edge agent in
this process (so that its carriers' state can be read the moment it changes), fed through its intake by
``EdgeClient``. Bounded: ``--rounds`` at most ``MAX_ROUNDS``, each scenario at most ``--budget`` seconds.

As root the script runs itself again inside ``unshare --net`` (a network namespace with only loopback),
so the nftables black-holes and ports touch nothing else; without root, scenarios that need a black-hole
are skipped. ``--write`` puts the figures in docs/BENCHMARKS.md (section ``chaos``).

Scenarios (issue 23 items 1, 2 and 3):

- ``black_hole``: every carrier's port black-holed (``bench.blackhole``: packets dropped, no RST) for
  ``--outage`` seconds under traffic, then restored: time from the restore to a carrier up again, intake
  refusals, requests lost (no answer) and stuck (answered only by their deadline).
- ``gateway_restart``: kill -9 of the gateway's process group under traffic, ``--down`` seconds down while
  the agent spools, a new gateway on the same ports: time from its spawn to its 'gateway ready' line and to
  the first OK answer after it, OVERLOADED refusals per request answered after the restart, lost, stuck,
  DEADLINE_EXCEEDED.
- ``carrier_black_hole``: the carrier the agent uses black-holed (both ways) under traffic while what it
  carried runs at the gateway (an in-process gateway whose backend calls take ``ANSWER_DELAY_S``), until
  the agent has every answer it was owed on it: how long after the black-hole those answers came, how many
  were stuck until their deadline, and that the gateway ran nothing twice (item 2).
- ``gateway_start``: the gateway started ``rounds`` times on an idle machine, spawn to 'gateway ready',
  with its start-up phases; with ``--baseline REV`` the same for the gateway of git revision REV,
  alternating, for a before/after from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.netns import reexec_in_namespace
from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.config import AgentConfig, load_config
from edgewire import new_id, pb

REPO = Path(__file__).resolve().parent.parent
MAX_ROUNDS = 10
CARRIERS = ("hgc", "pccw", "tgt")
NO_ANSWER = "no answer from the edge agent in time"  # EdgeClient's own answer: lost


# ---------------------------------------------------------------------- what a scenario reports


@dataclass
class Section:
    """A scenario's figures: a table (a row per round) and summary lines, or why it was skipped."""

    name: str
    title: str
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)
    skipped: str = ""
    data: list[dict[str, Any]] = field(default_factory=list)  # per round, for --json

    def markdown(self) -> str:
        from bench.report import table

        lines = [f"### {self.title}", ""]
        if self.skipped:
            return "\n".join([*lines, f"Skipped: {self.skipped}"])
        lines += [table(self.header, self.rows), ""]
        lines += [f"- {line}" for line in self.summary]
        return "\n".join(lines)


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def spread(values: Sequence[float]) -> str:
    """median (min-max) of some seconds."""
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


# ---------------------------------------------------------------------- the parts


def free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


def gateway_config(path: Path, models: Path, ports: Sequence[int]) -> Path:
    """A plaintext gateway on loopback: carriers on ``ports``, the embedded demo models."""
    carriers = "".join(
        f'[[carriers]]\nname = "{name}"\nbind = "tcp://127.0.0.1:{port}"\n'
        for name, port in zip(CARRIERS, ports, strict=True)
    )
    path.write_text(
        f'instance = "hk-gw-chaos"\n{carriers}[security]\nmode = "plaintext"\n[http]\nport = 0\n'
        f'[logging]\nformat = "json"\n[backends.embedded]\ntype = "onnx"\nrepository = "{models}"\n'
    )
    return path


class GatewayRun:
    """``python -m gateway --config PATH`` in its own process group, from ``root`` (a checkout); the
    wall-clock time of its spawn and of its 'gateway ready' line (the line's own timestamp)."""

    def __init__(self, config: Path, root: Path = REPO) -> None:
        self.config = config
        self.root = root
        self.proc: asyncio.subprocess.Process | None = None
        self.spawned_at = 0.0
        self.ready_at: float | None = None
        self.ready: dict[str, Any] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def start(self, timeout_s: float = 60.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(self.root)}
        self.spawned_at = time.time()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "--config",
            str(self.config),
            cwd=self.root,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._reader = asyncio.create_task(self._read())
        await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "gateway ready":
                    self.ready = record
                    stamp = datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00"))
                    self.ready_at = stamp.timestamp()
                    self._ready.set()

    @property
    def to_ready_s(self) -> float | None:
        return None if self.ready_at is None else self.ready_at - self.spawned_at

    def metric(self, name: str, labels: dict[str, str]) -> float:
        """The sum of the samples of the gateway's /metrics named ``name`` with ``labels`` (0: none)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.ready['http_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        return sum(
            float(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def kill9(self) -> None:
        """kill -9 of the whole process group (the CPU workers too), as systemd's KillMode does."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> None:
        self.kill9()
        if self.proc is not None:
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


def agent_config(endpoints: Sequence[str], spool: Path, **uplink: Any) -> AgentConfig:
    """A us-west agent on the given carriers with the production uplink defaults (``uplink`` overrides),
    no local tier: every request goes to Hong Kong."""
    return load_config(
        environ={},
        overrides={
            "region": "us-west",
            "intake": "tcp://127.0.0.1:*",
            "carriers": [{"name": n, "endpoint": e} for n, e in zip(CARRIERS, endpoints, strict=True)],
            "local": {"enabled": False},
            "spool": {"directory": str(spool)},
            "http": {"port": 0},
            "routing": {"thresholds": {"edge_server": 0.0, "cloud": 0.7}},
            "uplink": uplink,
        },
    )


def ranking_requests() -> list[pb.InferRequest]:
    """A few synthetic ranking requests scored for Hong Kong's cloud tier, copied for the traffic."""
    from edge_agent.synthetic import SyntheticTraffic

    out = []
    for generated in SyntheticTraffic(21, regions=("us-west",)).take(200):
        if generated.request.kind == pb.REQUEST_KIND_RANKING:
            request = pb.InferRequest()
            request.CopyFrom(generated.request)
            request.request_id = b""
            request.complexity_hint = 0.95
            out.append(request)
    return out[:16]


@dataclass
class Answer:
    at: float  # wall clock when the caller got it
    status: int
    message: str


class Traffic:
    """Open-loop interactive requests at ``rate`` per second through the agent's intake (one call per
    request, those due sent every 10 ms), each with ``deadline_s``; every answer kept with the time it
    came."""

    def __init__(self, client: EdgeClient, rate: float, deadline_s: float) -> None:
        self.client = client
        self.rate = rate
        self.deadline_s = deadline_s
        self.templates = ranking_requests()
        self.sent = 0
        self.answers: list[Answer] = []
        self._calls: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        tick = 0.01
        start = time.monotonic()
        while True:
            due = int((time.monotonic() - start) * self.rate) - self.sent
            for request in self._requests(max(0, due)):
                call = asyncio.create_task(self._call(request))
                self._calls.add(call)
                call.add_done_callback(self._calls.discard)
            await asyncio.sleep(tick)

    def _requests(self, n: int) -> list[pb.InferRequest]:
        out = []
        for i in range(n):
            request = pb.InferRequest()
            request.CopyFrom(self.templates[(self.sent + i) % len(self.templates)])
            out.append(request)
        self.sent += n
        return out

    async def _call(self, request: pb.InferRequest) -> None:
        response = await self.client.infer(
            request, deadline_s=self.deadline_s, priority=pb.PRIORITY_CLASS_INTERACTIVE
        )
        self.answers.append(Answer(time.time(), response.status, response.error_message))

    async def finish(self, timeout_s: float) -> None:
        """Stop sending; wait (bounded) for every answer."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._calls:
            await asyncio.wait(list(self._calls), timeout=timeout_s)
        for call in list(self._calls):  # past the bound: counted as unanswered
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)

    def counts(self, since: float = 0.0) -> dict[str, int]:
        """Answers after wall time ``since``: OK, lost (no answer at all), stuck (answered only when the
        deadline passed), refused at the intake, other; and how many are still unanswered (all time)."""
        chosen = [a for a in self.answers if a.at >= since]
        lost = sum(1 for a in chosen if a.message == NO_ANSWER)
        deadline = sum(1 for a in chosen if a.status == pb.STATUS_DEADLINE_EXCEEDED) - lost
        return {
            "answered": len(chosen),
            "ok": sum(1 for a in chosen if a.status == pb.STATUS_OK),
            "lost": lost,
            "stuck": deadline,
            "refused": sum(1 for a in chosen if a.status == pb.STATUS_OVERLOADED),
            "unanswered": self.sent - len(self.answers),
        }

    def first_ok_after(self, at: float) -> float | None:
        times = [a.at for a in self.answers if a.at >= at and a.status == pb.STATUS_OK]
        return min(times) - at if times else None


@dataclass
class Env:
    """What every scenario gets: a scratch directory, the demo models, the run's options."""

    work: Path
    models: Path
    rounds: int
    rate: float
    deadline_s: float
    budget_s: float
    args: argparse.Namespace
    uplink: dict[str, Any] = field(default_factory=dict)  # the agent's [uplink] overrides
    label: str = ""  # added to a section's title (the old agent settings)

    def scratch(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class NotInTime(TimeoutError):
    """A scenario's wait for a condition ran past its bound (not the scenario's --budget)."""


async def wait_until(
    predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.005, what: str = "a condition"
) -> float:
    """Poll ``predicate`` until true; the monotonic time it became so. NotInTime past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise NotInTime(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(interval_s)
    return time.monotonic()


@contextlib.contextmanager
def black_holes(ports: Sequence[int]) -> Iterator[None]:
    from bench.blackhole import BlackHole

    with contextlib.ExitStack() as stack:
        for port in ports:
            stack.enter_context(BlackHole(port))
        yield


# ---------------------------------------------------------------------- scenarios


async def scenario_black_hole(env: Env) -> Section:
    """Every carrier black-holed for ``--outage`` s under traffic, then restored (issue 23 item 1)."""
    from bench.blackhole import unavailable

    section = Section(
        "black_hole",
        f"Every carrier black-holed for {env.args.outage:g} s under {env.rate:g} req/s ({env.deadline_s:g} s "
        f"deadlines), then restored{env.label}",
        ["round", "restore -> carrier up (s)", "first carrier up", "its connect attempts retried"],
    )
    why = unavailable()
    if why:
        section.skipped = why
        return section
    work = env.scratch("black_hole")
    ports = free_ports(3)
    gateway = GatewayRun(gateway_config(work / "gw.toml", env.models, ports))
    await gateway.start()
    agent = EdgeAgent(agent_config([f"tcp://127.0.0.1:{p}" for p in ports], work / "spool", **env.uplink))
    await agent.start()
    ups: list[float] = []
    try:
        uplink = agent.uplink
        assert uplink is not None
        await wait_until(lambda: uplink.best() is not None, 20)
        async with EdgeClient(agent.intake_endpoint, service="chaos") as client:
            traffic = Traffic(client, env.rate, env.deadline_s)
            traffic.start()
            for n in range(1, env.rounds + 1):
                await asyncio.sleep(2.0)  # traffic flowing before the fault
                retried = {name: c.events["connect_retried"] for name, c in uplink.carriers.items()}
                with black_holes(ports):
                    holed = time.monotonic()
                    await wait_until(lambda: uplink.best() is None, 30, what="every carrier dead")
                    await asyncio.sleep(max(0.0, env.args.outage - (time.monotonic() - holed)))
                restored = time.monotonic()
                up_at = await wait_until(lambda: uplink.best() is not None, 120, what="a carrier up again")
                best = uplink.best()
                ups.append(up_at - restored)
                attempts = best.events["connect_retried"] - retried.get(best.name, 0) if best else 0
                section.rows.append(
                    [str(n), seconds(up_at - restored), best.name if best else "-", str(attempts)]
                )
            await asyncio.sleep(2.0)
            await traffic.finish(env.deadline_s + 5)
            counts = traffic.counts()
    finally:
        await agent.aclose()
        await gateway.stop()
    section.summary = [
        f"restore -> a carrier up: {spread(ups)} over {len(ups)} rounds (goal <= 3 s)",
        f"{counts['answered']} of {traffic.sent} requests answered: {counts['ok']} OK, "
        f"{counts['refused']} refused at the intake, {counts['lost']} lost, {counts['stuck']} stuck until "
        f"their deadline, {counts['unanswered']} unanswered at the end",
    ]
    section.data = [{"restore_to_up_s": u} for u in ups] + [counts]
    return section


async def scenario_gateway_restart(env: Env) -> Section:
    """kill -9 of the gateway under traffic, ``--down`` s down, a new one on the same ports (item 3)."""
    section = Section(
        "gateway_restart",
        f"kill -9 of the gateway under {env.rate:g} req/s ({env.deadline_s:g} s deadlines), "
        f"{env.args.down:g} s down, restarted on the same ports{env.label}",
        [
            "round",
            "backlog",
            "spawn -> ready (s)",
            "ready -> first OK (s)",
            "OVERLOADED / request",
            "gateway OVERLOADED",
            "answered after",
            "DEADLINE_EXCEEDED",
            "lost",
        ],
    )
    work = env.scratch("gateway_restart")
    ports = free_ports(3)
    config = gateway_config(work / "gw.toml", env.models, ports)
    gateway = GatewayRun(config)
    await gateway.start()
    agent = EdgeAgent(agent_config([f"tcp://127.0.0.1:{p}" for p in ports], work / "spool", **env.uplink))
    await agent.start()
    readies: list[float] = []
    first_oks: list[float] = []
    ratios: list[float] = []
    try:
        uplink = agent.uplink
        assert uplink is not None
        await wait_until(lambda: uplink.best() is not None, 20)
        async with EdgeClient(agent.intake_endpoint, service="chaos") as client:
            traffic = Traffic(client, env.rate, env.deadline_s)
            traffic.start()
            for n in range(1, env.rounds + 1):
                await asyncio.sleep(2.0)
                gateway.kill9()
                await gateway.stop()
                await wait_until(lambda: uplink.best() is None, 30, what="the gateway found gone")
                await asyncio.sleep(env.args.down)
                backlog = uplink.inflight
                refused_before = uplink.stats.nacks["overloaded"] + uplink.stats.resent["retryable_status"]
                gateway = GatewayRun(config)
                await gateway.start()
                spawned = gateway.spawned_at
                # Until the backlog is answered (bounded), then what happened since the spawn.
                with contextlib.suppress(TimeoutError):
                    await wait_until(lambda: uplink.inflight <= env.rate * 0.5, env.deadline_s + 10, 0.05)
                await asyncio.sleep(1.0)
                refused = (
                    uplink.stats.nacks["overloaded"]
                    + uplink.stats.resent["retryable_status"]
                    - refused_before
                )
                counts = traffic.counts(since=spawned)
                ready_s = gateway.to_ready_s
                first_ok = None if gateway.ready_at is None else traffic.first_ok_after(gateway.ready_at)
                ratio = refused / max(1, counts["answered"])
                gateway_nacks = gateway.metric(
                    "hkgw_requests_nacked_total", {"reason": "overloaded"}
                ) + gateway.metric("hkgw_responses_total", {"status": "overloaded"})
                if ready_s is not None:
                    readies.append(ready_s)
                if first_ok is not None:
                    first_oks.append(first_ok)
                ratios.append(ratio)
                deadline = counts["stuck"]
                section.rows.append(
                    [
                        str(n),
                        str(backlog),
                        seconds(ready_s),
                        seconds(first_ok),
                        f"{ratio:.3f}",
                        f"{gateway_nacks:.0f}",
                        str(counts["answered"]),
                        str(deadline),
                        str(counts["lost"]),
                    ]
                )
                section.data.append(
                    {
                        "backlog": backlog,
                        "spawn_to_ready_s": ready_s,
                        "ready_to_first_ok_s": first_ok,
                        "overloaded_per_request": ratio,
                        "gateway_overloaded_nacks": gateway_nacks,
                        "startup_ms": gateway.ready.get("startup_ms"),
                        **counts,
                    }
                )
            await traffic.finish(env.deadline_s + 5)
            total = traffic.counts()
    finally:
        await agent.aclose()
        await gateway.stop()
    section.summary = [
        f"spawn -> ready: {spread(readies)} (goal <= 2 s); ready -> first OK answer: {spread(first_oks)} "
        "(goal <= 1 s)",
        f"OVERLOADED refusals per request answered after the restart: max {max(ratios, default=0):.3f} "
        "(goal <= 0.1)",
        f"whole run: {total['answered']} of {traffic.sent} answered, {total['ok']} OK, "
        f"{total['stuck']} DEADLINE_EXCEEDED, {total['lost']} lost, {total['refused']} refused at the intake",
    ]
    return section


def checkout(revision: str, into: Path) -> None:
    """The files of git ``revision`` of this repository, written into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


async def scenario_gateway_start(env: Env) -> Section:
    """The gateway started ``rounds`` times (idle), spawn -> 'gateway ready', and its phases; with
    ``--baseline REV`` alternating with that revision's gateway."""
    section = Section(
        "gateway_start",
        "Gateway start-up, spawn -> 'gateway ready' (no traffic)",
        ["gateway", "runs", "spawn -> ready", "phases (median ms)"],
    )
    work = env.scratch("gateway_start")
    roots: dict[str, Path] = {"this checkout": REPO}
    if env.args.baseline:
        base = work / "baseline"
        await asyncio.to_thread(checkout, env.args.baseline, base)
        roots = {f"baseline {env.args.baseline}": base, **roots}
    times: dict[str, list[float]] = {name: [] for name in roots}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for _ in range(env.rounds):
        for name, root in roots.items():
            config = gateway_config(work / "gw.toml", env.models, free_ports(3))
            run = GatewayRun(config, root)
            try:
                await run.start()
            finally:
                await run.stop()
            if run.to_ready_s is not None:
                times[name].append(run.to_ready_s)
            phases[name].append(dict(run.ready.get("startup_ms") or {}))
    for name in roots:
        keys = sorted({k for p in phases[name] for k in p}, key=lambda k: list(phases[name][0]).index(k))
        medians = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in phases[name]):.0f}" for k in keys)
        section.rows.append([name, str(len(times[name])), spread(times[name]), medians or "-"])
    section.summary = [f"{name}: {spread(t)}" for name, t in times.items()]
    section.data = [{"gateway": n, "spawn_to_ready_s": t, "phases": phases[n]} for n, t in times.items()]
    return section


OLD_AGENT: dict[str, Any] = {
    "connect_timeout_ms": 600_000,  # none, in effect
    "tcp_maxrt_ms": 0,
    "reconnect_ivl_max_ms": 5000,
    "send_window_initial": 65_536,  # no send window: the whole backlog at once
    "retry_jitter": 0.0,
}
"""The agent's [uplink] before issue 23, for ``--old-agent``: what a scenario measured without its fix."""
OLD_AGENT_SCENARIOS = ("black_hole", "gateway_restart")
OLD_LABEL = " (old agent settings: no connect timeout, reconnect up to 5 s, no send window, no retry jitter)"

ANSWER_DELAY_S = 1.0
"""carrier_black_hole: every backend call takes this long (a slow GPU batch), so that requests are running
at the gateway when the carrier that brought them fails."""


class IdentifiedTraffic(Traffic):
    """``Traffic`` whose requests carry ids given here: when (monotonic) and how each was answered."""

    def __init__(self, client: EdgeClient, rate: float, deadline_s: float) -> None:
        super().__init__(client, rate, deadline_s)
        self.answered_at: dict[bytes, float] = {}
        self.status: dict[bytes, int] = {}

    def _requests(self, n: int) -> list[pb.InferRequest]:
        out = super()._requests(n)
        for request in out:
            request.request_id = new_id()
        return out

    async def _call(self, request: pb.InferRequest) -> None:
        await super()._call(request)
        self.answered_at[request.request_id] = time.monotonic()
        self.status[request.request_id] = self.answers[-1].status  # appended by that call, no await since


def gateway_total(gw: Any, sample: str) -> float:
    """The sum of an in-process gateway's samples named ``sample``, over every label value."""
    return float(
        sum(s.value for family in gw.metrics.registry.collect() for s in family.samples if s.name == sample)
    )


async def scenario_carrier_black_hole(env: Env) -> Section:
    """The carrier in use black-holed under traffic while requests it carried run at the gateway (slow
    backend calls): how long after the black-hole the agent has the answers it was owed (issue 23 item 2)."""
    from bench.blackhole import BlackHole, unavailable
    from gateway.testing import FaultInjectingBackend, run_gateway

    section = Section(
        "carrier_black_hole",
        f"The carrier in use black-holed under {env.rate:g} req/s, {ANSWER_DELAY_S:g} s backend calls",
        ["round", "accepted on it, unanswered", "answered after (s): median", "max", "stuck"],
    )
    why = unavailable()
    if why:
        section.skipped = why
        return section
    work = env.scratch("carrier_black_hole")
    slow = {"type": "fault-injecting", "inner": {"type": "null"}}
    gw_overrides: dict[str, Any] = {
        "backends": {"embedded": slow, "gpu": slow},
        "pools": {
            "cpu": {"backend": "embedded"},
            **{p: {"backend": "gpu"} for p in ("gpu-a100-mig", "gpu-a100", "gpu-v100")},
        },
        "logging": {"format": "json", "level": "error"},
    }
    medians: list[float] = []
    worst: list[float] = []
    owed_total = stuck_total = 0
    async with run_gateway(models_dir=env.models, **gw_overrides) as gw:
        for backend in gw.backends.values():
            assert isinstance(backend, FaultInjectingBackend)
            backend.delay_s = ANSWER_DELAY_S
        uplink_options = env.args.agent_uplink
        agent = EdgeAgent(agent_config([gw.endpoint(n) for n in CARRIERS], work / "spool", **uplink_options))
        await agent.start()
        try:
            uplink = agent.uplink
            assert uplink is not None
            await wait_until(lambda: uplink.best() is not None, 20, what="a carrier up")
            async with EdgeClient(agent.intake_endpoint, service="chaos") as client:
                traffic = IdentifiedTraffic(client, env.rate, env.deadline_s)
                traffic.start()
                for n in range(1, env.rounds + 1):
                    await asyncio.sleep(2.0)  # traffic flowing, some of it running at the gateway
                    # The carrier in use: the one holding most of what the gateway accepted, unanswered.
                    held = Counter(e.carrier for _, e in uplink.outstanding if e.accepted)
                    victim = uplink.carriers[held.most_common(1)[0][0]] if held else uplink.best()
                    assert victim is not None
                    with BlackHole(int(victim.endpoint.rsplit(":", 1)[1])):
                        holed = time.monotonic()
                        owed = [r for r, e in uplink.outstanding if e.accepted and e.carrier == victim.name]

                        def owed_answered(ids: tuple[bytes, ...] = tuple(owed)) -> bool:
                            return all(r in traffic.answered_at for r in ids)

                        with contextlib.suppress(TimeoutError):
                            await wait_until(
                                owed_answered,
                                env.deadline_s + 5,
                                interval_s=0.01,
                                what="the answers owed on the black-holed carrier",
                            )
                    after = [traffic.answered_at[r] - holed for r in owed if r in traffic.answered_at]
                    stuck = sum(1 for r in owed if traffic.status.get(r) != pb.STATUS_OK)
                    await wait_until(lambda: uplink.best() is not None, 60, what="a carrier up again")
                    owed_total += len(owed)
                    stuck_total += stuck
                    if after:
                        medians.append(statistics.median(after))
                        worst.append(max(after))
                    section.rows.append(
                        [
                            str(n),
                            str(len(owed)),
                            seconds(statistics.median(after) if after else None),
                            seconds(max(after) if after else None),
                            str(stuck),
                        ]
                    )
                    section.data.append({"owed": len(owed), "answered_after_s": after, "stuck": stuck})
                await traffic.finish(env.deadline_s + 5)
                counts = traffic.counts()
                not_ok = Counter(
                    f"{a.status}: {a.message}" for a in traffic.answers if a.status != pb.STATUS_OK
                )
                moved = int(gw.metrics.registry.get_sample_value("hkgw_replies_moved_total") or 0)
                reasks = uplink.stats.resent["carrier_down"]
                # Every request the gateway accepted was run once: the re-asks were duplicates.
                twice = gateway_total(gw, "hkgw_batch_size_sum") - gateway_total(
                    gw, "hkgw_requests_accepted_total"
                )
        finally:
            await agent.aclose()
    up = uplink_options
    section.summary = [
        f"requests accepted on the black-holed carrier and unanswered at the black-hole: {owed_total} over "
        f"{env.rounds} rounds, answered {spread(medians)} after it (median per round; worst "
        f"{max(worst, default=0):.2f} s), {stuck_total} stuck until their deadline (goal 0)",
        f"the agent re-asked for {reasks}; the gateway sent {moved} answers on another carrier than the one "
        f"asked on; uplink ping_interval_s {up.get('ping_interval_s', 0.5)}, dead_after_s "
        f"{up.get('dead_after_s', 2.0)}: the re-ask comes at most dead_after_s + ping_interval_s after the "
        "last Pong on the lost carrier",
        f"whole run: {counts['answered']} of {traffic.sent} answered, {counts['ok']} OK, {counts['stuck']} "
        f"DEADLINE_EXCEEDED, {counts['lost']} lost; the gateway ran {twice:.0f} requests more than it "
        "accepted (0: none run twice)",
    ]
    if not_ok:
        section.summary.append("not OK: " + ", ".join(f"{k} x{v}" for k, v in not_ok.most_common()))
    return section


SCENARIOS: dict[str, Callable[[Env], Awaitable[Section]]] = {
    "black_hole": scenario_black_hole,
    "gateway_restart": scenario_gateway_restart,
    "gateway_start": scenario_gateway_start,
    "carrier_black_hole": scenario_carrier_black_hole,
}


# ---------------------------------------------------------------------- running


async def run(args: argparse.Namespace) -> list[Section]:
    from inference.models.demo import write_demo_repository

    sections = []
    with tempfile.TemporaryDirectory(prefix="hkeg-chaos-") as tmp:
        work = Path(tmp)
        write_demo_repository(work / "models")
        rounds = max(1, min(args.rounds, MAX_ROUNDS))
        env = Env(
            work, work / "models", rounds, args.rate, args.deadline, args.budget, args, args.agent_uplink
        )
        old = Env(
            work, work / "models", rounds, args.rate, args.deadline, args.budget, args, OLD_AGENT, OLD_LABEL
        )
        runs = [(name, env) for name in args.scenario or list(SCENARIOS)]
        if args.old_agent:
            runs += [(name, old) for name, _ in list(runs) if name in OLD_AGENT_SCENARIOS]
        for name, run_env in runs:
            print(f"chaos: {name}{run_env.label} ...", file=sys.stderr, flush=True)
            try:
                section = await asyncio.wait_for(SCENARIOS[name](run_env), timeout=args.budget)
            except NotInTime as exc:
                section = Section(name, f"{name}{run_env.label}", skipped=f"stopped: {exc}")
            except TimeoutError:
                section = Section(name, name, skipped=f"did not finish within --budget {args.budget:g} s")
            section.name = f"{name}-old-agent" if run_env.label else name  # its own part of the docs
            sections.append(section)
            print(section.markdown(), file=sys.stderr, flush=True)
    return sections


def parse_uplink(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = json.loads(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    parser.add_argument("--rounds", type=int, default=3, help=f"faults per scenario (at most {MAX_ROUNDS})")
    parser.add_argument("--rate", type=float, default=200.0, help="requests/s offered (default 200)")
    parser.add_argument("--deadline", type=float, default=30.0, help="request deadline, s (default 30)")
    parser.add_argument("--outage", type=float, default=10.0, help="black_hole: seconds black-holed")
    parser.add_argument("--down", type=float, default=3.0, help="gateway_restart: seconds down")
    parser.add_argument("--baseline", help="gateway_start: also time the gateway of this git revision")
    parser.add_argument(
        "--agent-uplink",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="an agent [uplink] override, e.g. send_window_initial=65536 (repeatable)",
    )
    parser.add_argument(
        "--old-agent",
        action="store_true",
        help="also run black_hole and gateway_restart with the agent's pre-issue-23 [uplink] (OLD_AGENT)",
    )
    parser.add_argument("--budget", type=float, default=300.0, help="seconds per scenario at most")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md (section chaos)")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.chaos", argv)
    if code is not None:
        return code
    args.agent_uplink = parse_uplink(args.agent_uplink)
    sections = asyncio.run(run(args))
    if args.json:
        print(json.dumps([{s.title: s.data or s.skipped} for s in sections], indent=2, default=str))
    if args.write:
        write(sections, argv)
    return 0


def write(sections: Sequence[Section], argv: Sequence[str]) -> None:
    from bench.report import machine, stamp, update_section

    command = " ".join(["python -m bench.chaos", *argv])
    update_section(
        "chaos",
        "\n".join(
            [
                "## Recovery from faults (issue 23)",
                "",
                "`bench/chaos.py` (as root it runs itself inside `unshare --net`: loopback only): a real "
                "`hk-gateway` process, one edge agent with the production uplink defaults unless a section "
                "says otherwise, interactive ranking requests through its intake. "
                "'lost': no answer at all; 'stuck': answered only when its deadline passed. Each scenario's "
                "section is rewritten by a run that includes it.",
            ]
        ),
    )
    for section in sections:  # one marked section each: a run of some scenarios leaves the others' figures
        header = f"Command: `{command}`  \nMeasured {stamp()} on {machine()}."
        body = section.markdown().replace("\n\n", f"\n\n{header}\n\n", 1)
        update_section(f"chaos-{section.name}", body)


if __name__ == "__main__":
    sys.exit(main())
