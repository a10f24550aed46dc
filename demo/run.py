"""The main job of the README: a real gateway and realistic synthetic traffic, and what happened.

    python -m demo [--requests 1500] [--rate 300]

Starts ``hk-gateway`` with no arguments (three loopback carriers, the embedded ONNX demo models) and one
``edge-agent --region R`` process per region (each with its local tier, spool and uplink over all three
carriers), as production runs them; this process plays the local services, feeding each agent its
region's share of realistic synthetic traffic through its intake with the client library, and prints
progress while it runs. Then it prints the outcome (every answer that was not OK with what it means),
what the agents cost in CPU per request, stops the agents and the gateway with SIGTERM and shows that
they drained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from demo.outcomes import explain, explain_all, grouped, unexplained
from demo.processes import (
    Child,
    machine_busy,
    process_cpu_s,
    start_child,
    thread_cpu_s,
    tree_cpu_s,
)
from edge_agent.drive import DriveResult, drive_requests, synthetic_requests
from edge_agent.synthetic import PROFILES, SyntheticRequest
from service.runtime import run_main

CARRIERS = ("hgc", "pccw", "tgt")
GATEWAY_METRICS = ("hkgw_requests_accepted_total", "hkgw_route_decisions_total", "hkgw_cpu_worker_restarts")
OK_GOAL = 0.99
PROGRESS_EVERY_S = 1.0
READY_TIMEOUT_S = 30.0
IDLE_S = 1.5
AGENT_COUNTERS = {
    "edge_failed_fast": "failed fast",
    "edge_resent": "resent",
    "edge_nacks": "nacked by HK",
    "edge_duplicate_responses": "duplicate answers dropped",
    "edge_late_responses": "late answers dropped",
    "edge_orphan_responses": "orphan answers",
}
AGENT_TOML = """\
region = "{region}"
intake = "tcp://127.0.0.1:*"
{carriers}
[local]
repository = "{models}"

[spool]
directory = "{spool}"

[http]
port = 0

[logging]
format = "json"
"""


@dataclass
class Agent:
    """One region's ``edge-agent`` process, its traffic and what it cost."""

    region: str
    child: Child
    result: DriveResult = field(default_factory=DriveResult)
    cpu_idle_per_s: float = 0.0  # CPU seconds per second before any traffic (pings, timers)
    cpu_run_s: float = 0.0  # CPU seconds while the traffic ran
    threads_run_s: dict[str, float] = field(default_factory=dict)
    counters: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    exit_code: int | None = None
    unanswered: int | None = None

    @property
    def intake(self) -> str:
        return str(self.child.ready["intake"])

    @property
    def http_port(self) -> int:
        return int(self.child.ready["http_port"])


@dataclass
class Run:
    """The whole demo's measurements."""

    agents: list[Agent]
    seconds: float = 0.0
    machine_busy_cores: float = 0.0
    gateway_pid: int = 0
    gateway_cpu_s: float = 0.0
    gateway_exit_code: int | None = None
    driver_cpu_s: float = 0.0


# ---------------------------------------------------------------------- processes


async def start_gateway(workdir: Path) -> Child:
    return await start_child(
        "hk-gateway", ["gateway", "--log-format", "json"], "gateway ready", workdir / "hk-gateway.log"
    )


async def start_agents(
    endpoints: dict[str, str], workdir: Path, launchers: Mapping[str, Sequence[str]] | None = None
) -> list[Agent]:
    """``edge-agent --region R --config var/agents/R.toml`` per region, started together; returned once
    each logged "agent ready" (its intake and HTTP ports). ``launchers``: per region, the module (and
    its arguments) that runs that agent's command line instead of ``edge_agent`` (a profiler)."""
    folder = workdir / "agents"
    folder.mkdir(parents=True, exist_ok=True)
    carriers = "".join(
        f'\n[[carriers]]\nname = "{name}"\nendpoint = "{endpoint}"\n' for name, endpoint in endpoints.items()
    )
    starts = []
    for profile in PROFILES:
        config = folder / f"{profile.name}.toml"
        config.write_text(
            AGENT_TOML.format(
                region=profile.name,
                carriers=carriers,
                models=workdir / "models",
                spool=workdir / "spool",
            )
        )
        launcher = (launchers or {}).get(profile.name, ["edge_agent"])
        argv = [*launcher, "--region", profile.name, "--config", str(config)]
        starts.append(
            start_child(f"edge-agent {profile.name}", argv, "agent ready", folder / f"{profile.name}.log")
        )
    children = await asyncio.gather(*starts, return_exceptions=True)
    failed = [c for c in children if isinstance(c, BaseException)]
    started = [c for c in children if isinstance(c, Child)]
    if failed:
        await asyncio.gather(*(c.stop() for c in started))
        raise failed[0]
    return [Agent(p.name, c) for p, c in zip(PROFILES, started, strict=True)]


async def wait_until_linked(session: aiohttp.ClientSession, agents: list[Agent]) -> None:
    """Poll each agent's /readyz (with a deadline) until it has a live carrier to Hong Kong."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for agent in agents:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{agent.http_port}/readyz") as resp:
                    if "hong_kong=up" in await resp.text():
                        break
            if time.monotonic() > deadline:
                raise SystemExit(f"edge-agent {agent.region}: no carrier to Hong Kong came up")
            await asyncio.sleep(0.05)


async def metrics(session: aiohttp.ClientSession, port: int) -> Iterator[tuple[str, dict[str, str], float]]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        body = await resp.text()
    return (
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    )


# ---------------------------------------------------------------------- traffic


def build_traffic(n: int, rate: float, seed: int) -> dict[str, list[SyntheticRequest]]:
    """Each region's share of ``n`` requests arriving at its share of ``rate``."""
    total_share = sum(p.share for p in PROFILES)
    out = {}
    for profile in PROFILES:
        share = profile.share / total_share
        out[profile.name] = synthetic_requests(profile.name, max(1, round(n * share)), rate * share, seed)
    return out


async def drive_all(agents: list[Agent], traffic: dict[str, list[SyntheticRequest]]) -> float:
    """Every agent's traffic at once, with a progress line every second; returns the seconds from the
    first request to the last answer."""
    planned = sum(len(t) for t in traffic.values())
    start = time.perf_counter() + 0.05
    drives = asyncio.gather(
        *(drive_requests(a.intake, traffic[a.region], a.result, start=start) for a in agents)
    )
    while not drives.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(drives), PROGRESS_EVERY_S)
        print(progress(agents, planned, time.perf_counter() - start), flush=True)
    await drives
    return time.perf_counter() - start


def progress(agents: list[Agent], planned: int, elapsed: float) -> str:
    sent = sum(a.result.sent for a in agents)
    answered = sum(a.result.answered for a in agents)
    ok = sum(a.result.by_status["OK"] for a in agents)
    lost = sum(a.result.lost for a in agents)
    return (
        f"  {elapsed:5.1f} s  sent {sent:>5}/{planned}  answered {answered:>5}  OK {ok:>5}  "
        f"not OK {answered - ok}  lost {lost}"
    )


# ---------------------------------------------------------------------- the summary


def summarise(run: Run) -> str:
    agents = run.agents
    totals: Counter[str] = Counter()
    routes: Counter[str] = Counter()
    not_ok: Counter[tuple[str, str]] = Counter()
    latencies: list[float] = []
    for a in agents:
        totals.update(a.result.by_status)
        routes.update(a.result.by_route)
        not_ok.update(a.result.not_ok)
        latencies.extend(a.result.latencies_ms)
    sent = sum(a.result.sent for a in agents)
    lost = sum(a.result.lost for a in agents)
    answered = sum(a.result.answered for a in agents)
    p50, p90, p99 = np.percentile(np.array(latencies), [50, 90, 99]) if latencies else (0.0, 0.0, 0.0)
    ok_share = 100 * totals["OK"] / sent if sent else 0.0
    goal = "met" if ok_share >= 100 * OK_GOAL else "NOT met"
    lines = [
        f"sent {sent} requests through {len(agents)} edge agents (one per region); lost {lost}",
        "answered: "
        + ", ".join(f"{k} {v}" for k, v in totals.most_common())
        + f" ({ok_share:.1f}% OK; goal >= {OK_GOAL:.0%}: {goal})",
        "by tier / pool: " + ", ".join(f"{k} {v}" for k, v in routes.most_common()),
        f"caller latency: p50 {p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms",
    ]
    if not_ok:
        lines.append(
            f"not OK: {answered - totals['OK']}, by status and message (who answered, and what it means):"
        )
        lines.extend(explain_all(not_ok))
        missing = unexplained(not_ok)
        if missing:
            lines.append(
                f"  ({len(missing)} kinds of answer are not explained: add them to demo/outcomes.py)"
            )
    else:
        lines.append("not OK: none")
    lines.append("per region (agent CPU: its process's CPU while the traffic ran, per request it took):")
    for a in agents:
        r, d, c = a.result, a.result.as_dict(), a.counters
        lines.append(
            f"  {a.region:<15} sent {r.sent:>5}  lost {r.lost}  ok {r.by_status['OK']:>5}  "
            f"edge {c['served at the edge']:>4.0f}  to HK {c['sent to Hong Kong']:>4.0f}  "
            f"p50 {d['latency_ms']['p50']:>6} ms  p99 {d['latency_ms']['p99']:>7} ms  "
            f"CPU {1000 * a.cpu_run_s / max(1, r.sent):.2f} ms/req"
        )
        extra = ", ".join(
            f"{label} {int(a.counters[label])}" for label in AGENT_COUNTERS.values() if a.counters[label]
        )
        if extra:
            lines.append(f"  {'':<15} {extra}")
    lines.extend(cpu_lines(run))
    logged: Counter[tuple[str, str]] = Counter()
    for a in agents:
        logged.update(a.child.events)
    if logged:
        lines.append(
            "agents logged: " + ", ".join(f"{n} {lvl} {ev!r}" for (lvl, ev), n in logged.most_common(8))
        )
    return "\n".join(lines)


def cpu_lines(run: Run) -> list[str]:
    """The agents' CPU per request, gross and less their idle cost, by thread kind."""
    sent = sum(a.result.sent for a in run.agents) or 1
    gross = sum(a.cpu_run_s for a in run.agents)
    idle = sum(a.cpu_idle_per_s for a in run.agents) * run.seconds
    threads: defaultdict[str, float] = defaultdict(float)
    for a in run.agents:
        for kind, seconds in a.threads_run_s.items():
            threads[kind] += seconds
    by_thread = ", ".join(
        f"{kind} {1000 * s / sent:.2f}" for kind, s in sorted(threads.items(), key=lambda kv: -kv[1])
    )
    cores = os.cpu_count() or 1
    return [
        f"edge agents' CPU: {1000 * gross / sent:.2f} ms per request ({gross:.2f} s for {sent} requests in "
        f"{run.seconds:.1f} s, {len(run.agents)} processes; {1000 * (gross - idle) / sent:.2f} ms without "
        f"their idle {1000 * idle / max(run.seconds, 1e-9) / len(run.agents):.1f} ms/s each)",
        f"  by thread, ms per request: {by_thread}",
        f"hk-gateway's CPU (with its workers): {1000 * run.gateway_cpu_s / sent:.2f} ms per request; this "
        f"driver's: {1000 * run.driver_cpu_s / sent:.2f} ms; the machine was "
        f"{run.machine_busy_cores:.2f} of {cores} cores busy while the traffic ran (every process counted)",
    ]


async def read_counters(session: aiohttp.ClientSession, agent: Agent) -> None:
    """What the agent counted that the callers do not see (from its /metrics)."""
    want = {f"{name}_total": label for name, label in AGENT_COUNTERS.items()}
    for name, labels, value in await metrics(session, agent.http_port):
        if name == "edge_requests_total":
            route = labels.get("route")
            if route == "local":
                agent.counters["served at the edge"] += value
            elif route == "remote":
                agent.counters["sent to Hong Kong"] += value
        elif name in want:
            agent.counters[want[name]] += value


async def scrape_gateway(session: aiohttp.ClientSession, port: int, names: Sequence[str]) -> list[str]:
    health = []
    for carrier in CARRIERS:
        async with session.get(f"http://127.0.0.1:{port}/health/carriers/{carrier}") as resp:
            health.append(f"  /health/carriers/{carrier}: {resp.status} {(await resp.text()).strip()}")
    picked = [
        f"  {name}{{{','.join(f'{k}={v!r}' for k, v in labels.items())}}} {value:g}"
        for name, labels, value in await metrics(session, port)
        if name.startswith(tuple(names))
    ]
    return health + picked


# ---------------------------------------------------------------------- main


async def main_async(args: argparse.Namespace) -> int:
    workdir = Path.cwd() / "var"
    workdir.mkdir(exist_ok=True)
    gateway = await start_gateway(workdir)
    carriers = gateway.ready["carriers"]
    assert isinstance(carriers, dict)
    port = int(gateway.ready["http_port"])
    print(f"hk-gateway ready (pid {gateway.pid}): carriers {carriers}, http :{port}", flush=True)
    agents: list[Agent] = []
    run: Run | None = None
    try:
        agents = await start_agents({k: str(v) for k, v in carriers.items()}, workdir)
        for a in agents:
            print(
                f"edge-agent --region {a.region:<15} pid {a.child.pid:>7}  intake {a.intake}  "
                f"http :{a.http_port}  log {a.child.log_path}",
                flush=True,
            )
        async with aiohttp.ClientSession() as session:
            await wait_until_linked(session, agents)
            run = await measured_run(agents, gateway, args)
            for a in agents:
                await read_counters(session, a)
            print(summarise(run))
            print("health and a few metrics:")
            print("\n".join(await scrape_gateway(session, port, GATEWAY_METRICS)))
    finally:
        stopped = await asyncio.gather(*(a.child.stop() for a in agents))
        for a, exit_code in zip(agents, stopped, strict=True):
            a.exit_code = exit_code
            drained = a.child.last("drained")
            a.unanswered = int(drained["unanswered"]) if drained is not None else None
        if agents:
            codes = Counter(a.exit_code for a in agents)
            print(
                f"SIGTERM: the edge agents drained ({sum(a.unanswered or 0 for a in agents)} unanswered) and "
                "exited with " + ", ".join(f"{c} ({n} of them)" for c, n in codes.items())
            )
        gateway_code = await gateway.stop()
        print(f"SIGTERM: hk-gateway drained and exited with {gateway_code}")
    assert run is not None
    run.gateway_exit_code = gateway_code
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(run), indent=2) + "\n")
    clean = gateway_code == 0 and all(a.exit_code == 0 for a in agents)
    return 0 if clean and sum(a.result.lost for a in agents) == 0 else 1


def as_json(run: Run) -> dict[str, Any]:
    """The run's figures for a test or a benchmark: outcome, every non-OK answer explained, CPU."""
    sent = sum(a.result.sent for a in run.agents)
    not_ok: Counter[tuple[str, str]] = Counter()
    for a in run.agents:
        not_ok.update(a.result.not_ok)
    not_ok = grouped(not_ok)
    return {
        "sent": sent,
        "answered": sum(a.result.answered for a in run.agents),
        "ok": sum(a.result.by_status["OK"] for a in run.agents),
        "lost": sum(a.result.lost for a in run.agents),
        "not_ok": [
            {
                "status": status,
                "error_message": message,
                "count": count,
                "explanation": None if (why := explain(status, message)) is None else why.render(),
            }
            for (status, message), count in not_ok.most_common()
        ],
        "seconds": run.seconds,
        "machine_busy_cores": run.machine_busy_cores,
        "gateway": {"pid": run.gateway_pid, "exit_code": run.gateway_exit_code, "cpu_s": run.gateway_cpu_s},
        "driver": {"pid": os.getpid(), "cpu_s": run.driver_cpu_s},
        "agents": [
            {
                "region": a.region,
                "pid": a.child.pid,
                "exit_code": a.exit_code,
                "unanswered_at_stop": a.unanswered,
                "sent": a.result.sent,
                "ok": a.result.by_status["OK"],
                "cpu_s": a.cpu_run_s,
                "cpu_idle_per_s": a.cpu_idle_per_s,
                "threads_cpu_s": a.threads_run_s,
                "counters": dict(a.counters),
            }
            for a in run.agents
        ],
    }


async def measured_run(agents: list[Agent], gateway: Child, args: argparse.Namespace) -> Run:
    """The agents' idle CPU first (while this process builds the traffic), then the traffic, with CPU
    measured around it."""
    run = Run(agents, gateway_pid=gateway.pid)
    idle_from = time.monotonic()
    idle_cpu = {a.region: process_cpu_s(a.child.pid) for a in agents}
    traffic = build_traffic(args.requests, args.rate, args.seed)
    # At least a second of idling (pings and timers only), for a CPU figure above the clock's 10 ms tick.
    await asyncio.sleep(max(0.0, idle_from + IDLE_S - time.monotonic()))
    idle_s = time.monotonic() - idle_from
    for a in agents:
        a.cpu_idle_per_s = (process_cpu_s(a.child.pid) - idle_cpu[a.region]) / idle_s
    before = {a.region: (process_cpu_s(a.child.pid), thread_cpu_s(a.child.pid)) for a in agents}
    gateway_before = tree_cpu_s(gateway.pid)
    driver_before = time.process_time()
    busy_before, total_before = machine_busy()
    run.seconds = await drive_all(agents, traffic)
    busy_after, total_after = machine_busy()
    run.driver_cpu_s = time.process_time() - driver_before
    run.gateway_cpu_s = tree_cpu_s(gateway.pid) - gateway_before
    run.machine_busy_cores = (
        (busy_after - busy_before) / max(total_after - total_before, 1) * (os.cpu_count() or 1)
    )
    for a in agents:
        cpu, threads = before[a.region]
        a.cpu_run_s = process_cpu_s(a.child.pid) - cpu
        a.threads_run_s = {k: s - threads.get(k, 0.0) for k, s in thread_cpu_s(a.child.pid).items()}
    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=300.0, help="offered requests per second, all regions")
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the run's figures as JSON")
    return run_main(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
