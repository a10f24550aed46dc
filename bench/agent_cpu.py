"""The edge agent's CPU per request in the README's main job (issue 23 item 5).

    python -m bench.agent_cpu [--runs 3] [--requests 1500] [--rate 300] [--write]

Part 1 runs ``python -m demo --json`` (hk-gateway, six ``edge-agent`` processes, this rate of synthetic
traffic through their intakes) ``--runs`` times and takes the agents' CPU from /proc: per request, less
their idle cost, and by thread (event loop, ZeroMQ's I/O thread, the rest: the local tier's CPU and ONNX
threads, the spool's fsync). Part 2 runs the same job once more with one agent (``--profile-region``)
under cProfile with a CPU clock (``time.thread_time``: the event loop thread's CPU, not its waits),
switched on for the traffic only, and splits that thread's CPU by part of the agent. cProfile slows
what it measures (each Python call costs more), so part 2 gives shares, part 1 the figures. As root,
the script runs itself inside ``unshare --net`` (loopback only), as the tests do.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

from bench.netns import reexec_in_namespace
from bench.report import machine, stamp, table, update_section

REPO: Final = Path(__file__).resolve().parent.parent
PROFILE_READY_TIMEOUT_S: Final = 10.0

# Where a function's own CPU goes, by the file it is in (first match); functions of no part (builtins,
# enum, numpy internals...) go to the part of the function that called them.
PARTS: Final = (
    ("edge_agent/uplink/", "uplink (frames to and from Hong Kong)"),
    ("edge_agent/spool/", "spool"),
    ("edge_agent/local", "local tier (batching, pipelines, ONNX call)"),
    ("inference/profile.py", "routing decision"),
    ("routing/", "routing decision"),
    ("inference/", "local tier (batching, pipelines, ONNX call)"),
    ("edge_agent/intake.py", "intake, admission, Acks and answers to callers"),
    ("edge_agent/admission.py", "intake, admission, Acks and answers to callers"),
    ("edge_agent/callers.py", "intake, admission, Acks and answers to callers"),
    ("edge_agent/sockets.py", "intake, admission, Acks and answers to callers"),
    ("edgewire/", "wire codec (intake and uplink frames)"),
    ("zmq/", "pyzmq and zmq.asyncio (sends, receive futures, poll flags)"),
    ("asyncio/", "event loop machinery (tasks, futures, timers)"),
    ("uvloop/", "event loop machinery (tasks, futures, timers)"),
    ("concurrent/futures/", "event loop machinery (tasks, futures, timers)"),
    ("threading.py", "event loop machinery (tasks, futures, timers)"),
    ("edge_agent/", "agent: other (housekeeping, HTTP, discovery)"),
    ("aiohttp/", "agent: other (housekeeping, HTTP, discovery)"),
    ("prometheus_client/", "agent: other (housekeeping, HTTP, discovery)"),
)
UNATTRIBUTED: Final = "the loop itself (uvloop's C code)"
READING: Final = """\
Reading it: at this rate each request arrives alone (one intake frame, a local batch of one, an Ack
and an answer frame, each send waking ZeroMQ's I/O thread), so the cost is per wake-up more than per
request: the same job at 1,500 requests/s (`python -m demo --requests 4000 --rate 1500`, 2026-12-02,
machine 1.94 cores busy) cost the agents 0.67 ms per request. The whole job (agents, gateway, driver)
uses about a third of this machine's two cores at its default rate.

Cut for issue 23 (edge_agent/local.py): the local tier serialized each request and parsed it again
before its pipeline, and parsed each answer it had just serialized; ranking and text batches (up to
64 KiB) are now prepared and finished on the event loop instead of two hand-offs to the CPU thread.
Same job, trees differing only in local.py, alternating runs on the shared machine (1.2-2.0 of its
cores busy with other work): 2.31 / 2.43 ms per request before, 2.03 / 2.14 after (event loop 1.38 /
1.49 -> 1.63 / 1.70, other threads 0.76 / 0.78 -> 0.25 / 0.29).

What is left, by the profile: zmq.asyncio's futures and poll-flag enums on every receive and send of
the intake and the uplink (the gateway's carriers read their ROUTER from the loop's reader callback on
a plain socket for this reason: 'Whole path' item 1); the ONNX call on a thread of its own (run inline
for small ranking and text batches, an experiment, it went from 2.21 / 2.39 / 2.49 to 1.98 / 2.03 /
2.29 ms, alternating); the pipelines' fixed cost per batch of one; the wire codec's per-frame work."""


# ---------------------------------------------------------------------- the profiled agent


def profiled_agent(out: Path, argv: list[str]) -> int:
    """``edge-agent ARGV`` with cProfile (thread CPU clock) on its event loop thread between SIGUSR1 and
    SIGUSR2; SIGUSR2 writes the stats to ``out``. Each step is logged as a JSON line on stderr."""
    from edge_agent.cli import main

    profile = cProfile.Profile(time.thread_time)

    def note(event: str) -> None:
        sys.stderr.write(json.dumps({"event": event, "level": "info"}) + "\n")
        sys.stderr.flush()

    def start(signum: int, frame: FrameType | None) -> None:
        profile.enable()
        note("profiling")

    def stop(signum: int, frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(out)
        note("profile written")

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    return main(argv)


def split_by_part(stats: pstats.Stats) -> dict[str, float]:
    """CPU seconds by part of the agent: each function's own time goes to the part of its file, or, for
    functions of no part, shared among its callers' parts as cProfile recorded the calls."""
    table_: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]  # pstats keeps it untyped
    memo: dict[Any, dict[str, float]] = {}

    def part_of(func: tuple[str, int, str]) -> str | None:
        path = func[0].replace("\\", "/")
        return next((part for prefix, part in PARTS if prefix in path), None)

    def shares(func: Any, depth: int = 0) -> dict[str, float]:
        """How ``func``'s own time divides among parts (fractions summing to 1)."""
        if func in memo:
            return memo[func]
        part = part_of(func)
        if part is not None:
            result = {part: 1.0}
        else:
            callers = table_.get(func, (0, 0, 0.0, 0.0, {}))[4]
            weights = {caller: entry[2] for caller, entry in callers.items() if entry[2] > 0}
            total = sum(weights.values())
            result = {}
            if total > 0 and depth < 12:
                memo[func] = {UNATTRIBUTED: 1.0}  # a cycle of callers ends here
                for caller, weight in weights.items():
                    for name, share in shares(caller, depth + 1).items():
                        result[name] = result.get(name, 0.0) + share * weight / total
            else:
                result = {UNATTRIBUTED: 1.0}
        memo[func] = result
        return result

    out: dict[str, float] = defaultdict(float)
    for func, (_, _, own, _, _) in table_.items():
        for part, share in shares(func).items():
            out[part] += own * share
    return dict(out)


# ---------------------------------------------------------------------- the runs


def demo_run(requests: int, rate: float) -> dict[str, Any]:
    """``python -m demo --json`` in a fresh directory; its figures."""
    with tempfile.TemporaryDirectory(prefix="hkeg-agent-cpu-") as tmp:
        out = Path(tmp) / "run.json"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "demo",
                "--requests",
                str(requests),
                "--rate",
                str(rate),
                "--json",
                str(out),
            ],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"python -m demo failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        figures: dict[str, Any] = json.loads(out.read_text())
        return figures


def per_request(run: dict[str, Any]) -> dict[str, float]:
    """The agents' CPU in ms per request: gross, less idle, by thread kind; the gateway's and driver's."""
    sent = run["sent"] or 1
    agents = run["agents"]
    gross = sum(a["cpu_s"] for a in agents)
    idle = sum(a["cpu_idle_per_s"] for a in agents) * run["seconds"]
    out = {
        "agents": 1000 * gross / sent,
        "agents_less_idle": 1000 * (gross - idle) / sent,
        "idle_ms_per_s_each": 1000 * idle / max(run["seconds"], 1e-9) / len(agents),
        "gateway": 1000 * run["gateway"]["cpu_s"] / sent,
        "driver": 1000 * run["driver"]["cpu_s"] / sent,
        "busy_cores": run["machine_busy_cores"],
        "ok_share": 100 * run["ok"] / sent,
    }
    for a in agents:
        for kind, seconds in a["threads_cpu_s"].items():
            out[f"thread: {kind}"] = out.get(f"thread: {kind}", 0.0) + 1000 * seconds / sent
    return out


async def profiled_run(
    requests: int, rate: float, region: str, seed: int
) -> tuple[dict[str, float], int, float]:
    """The demo's job once more, ``region``'s agent under cProfile during the traffic: (CPU seconds of
    its event loop thread by part, requests it took, its process CPU seconds meanwhile)."""
    import aiohttp

    from demo import run as demo
    from demo.processes import process_cpu_s

    # The profiled agent runs this module: importable from the run's directory too.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="hkeg-agent-cpu-") as tmp:
        work = Path(tmp) / "var"
        work.mkdir()
        stats_path = Path(tmp) / f"{region}.prof"
        cwd = Path.cwd()
        os.chdir(tmp)  # the gateway writes its models under var/ of its working directory
        try:
            gateway = await demo.start_gateway(work)
            agents: list[demo.Agent] = []
            try:
                carriers = {k: str(v) for k, v in gateway.ready["carriers"].items()}
                launcher = ["bench.agent_cpu", "--profiled-agent", str(stats_path), "--"]
                agents = await demo.start_agents(carriers, work, {region: launcher})
                target = next(a for a in agents if a.region == region)
                async with aiohttp.ClientSession() as session:
                    await demo.wait_until_linked(session, agents)
                traffic = demo.build_traffic(requests, rate, seed)
                os.kill(target.child.pid, signal.SIGUSR1)
                await _logged(target.child, "profiling")
                before = process_cpu_s(target.child.pid)
                await demo.drive_all(agents, traffic)
                cpu = process_cpu_s(target.child.pid) - before
                os.kill(target.child.pid, signal.SIGUSR2)
                await _logged(target.child, "profile written")
            finally:
                await asyncio.gather(*(a.child.stop() for a in agents))
                await gateway.stop()
            parts = split_by_part(pstats.Stats(str(stats_path)))
            return parts, target.result.sent, cpu
        finally:
            os.chdir(cwd)


async def _logged(child: Any, event: str) -> None:
    """Wait (bounded) until ``child`` logged ``event``; the agent's loop runs Python, and so the signal
    handler, at its next wake-up (a ping every 0.5 s at the latest)."""
    deadline = time.monotonic() + PROFILE_READY_TIMEOUT_S
    while child.last(event) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{child.name}: no {event!r} line within {PROFILE_READY_TIMEOUT_S:g} s")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------------- report


def render(
    args: argparse.Namespace,
    runs: list[dict[str, float]],
    profile: tuple[dict[str, float], int, float] | None,
) -> str:
    keys = [k for k in runs[0] if k.startswith("thread: ")]
    med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in {*runs[0], *keys}}

    def each(key: str) -> str:
        return " / ".join(f"{r.get(key, 0.0):.2f}" for r in runs)

    rows = [
        ["edge agents, all six (per request they took)", f"**{med['agents']:.2f}**", each("agents")],
        [
            "the same less their idle cost (pings, timers)",
            f"{med['agents_less_idle']:.2f}",
            each("agents_less_idle"),
        ],
        *(
            [f"&nbsp;&nbsp;{k.removeprefix('thread: ')}", f"{med[k]:.2f}", each(k)]
            for k in sorted(keys, key=lambda k: -med[k])
        ),
        ["hk-gateway with its CPU workers", f"{med['gateway']:.2f}", each("gateway")],
        ["the driver (this job's local services)", f"{med['driver']:.2f}", each("driver")],
    ]
    lines = [
        "## Edge agent CPU per request in the main job (issue 23 item 5)",
        "",
        f"Command: `python -m bench.agent_cpu --runs {args.runs} --requests {args.requests} "
        f"--rate {args.rate:g} --write`  ",
        f"Measured {stamp()} on {machine()}; {len(runs)} run(s) of `python -m demo --requests "
        f"{args.requests} --rate {args.rate:g}` (hk-gateway, six `edge-agent --region R` processes, the "
        "driver; median, then each run). The machine was "
        + " / ".join(f"{r['busy_cores']:.2f}" for r in runs)
        + " of its cores busy while the traffic ran (every process on it counted, other work included); "
        "answered OK: " + " / ".join(f"{r['ok_share']:.1f}%" for r in runs) + ".",
        "",
        table(["CPU, ms per request", "median", "each run"], rows),
        "",
        f"Idle, each agent used {med['idle_ms_per_s_each']:.1f} ms of CPU per second (pings to three "
        "carriers every 0.5 s, timers).",
        "",
        READING,
    ]
    if profile is not None:
        parts, taken, cpu = profile
        total = sum(parts.values()) or 1.0
        lines += [
            "",
            f"Where the event loop's CPU goes, one agent ({args.profile_region}, {taken} requests) under "
            f"cProfile with a CPU clock (its process: {1000 * cpu / max(taken, 1):.2f} ms per request with "
            "the profiler on; shares, not figures: each Python call costs more when profiled):",
            "",
            table(
                ["part of the agent", "share of the loop's CPU"],
                [
                    [part, f"{100 * seconds / total:.0f}%"]
                    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1])
                ],
            ),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--profiled-agent"]:
        return profiled_agent(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--profile-region", default="us-east", help="the agent profiled in part 2")
    parser.add_argument("--no-profile", action="store_true", help="skip part 2")
    parser.add_argument("--write", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.agent_cpu", argv)
    if code is not None:
        return code
    runs = []
    for i in range(max(1, args.runs)):
        runs.append(per_request(demo_run(args.requests, args.rate)))
        print(f"run {i + 1}: agents {runs[-1]['agents']:.2f} ms per request", flush=True)
    profile = None
    if not args.no_profile:
        from service.runtime import run_main

        profile = run_main(profiled_run(args.requests, args.rate, args.profile_region, args.seed))
    body = render(args, runs, profile)
    print(body)
    if args.write:
        update_section("agent-cpu", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
