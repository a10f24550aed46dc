"""An agent's realtime requests while its own batch flood fills it: ``[uplink] realtime_reserve`` against
none, the same code and gateway in the same run.

    python -m bench.agent_reserve [--seconds 5] [--repeats 2] [--rate 50] [--max-inflight 65536 1024]
                                  [--queue-depth 256] [--write]

One gateway (null backend with a simulated device: 5 ms a call plus 0.2 ms a row, waited without CPU, so
Hong Kong, not the agent, bounds the flood; a GPU cannot run here; each pool's queue ``--queue-depth``, so
Hong Kong refuses the flood's excess OVERLOADED and the agent's send window halves) and, in turns, an edge
agent with ``realtime_reserve = 16`` (the default) and one with ``0``, for each ``--max-inflight`` (what
the agent holds for Hong Kong: 65,536, the default, more than this driver keeps waiting, so the send window
is the bound; 1,024, less, so the intake is full too). This process feeds each agent's intake with batch
requests as fast as it takes them (at most 2,000 waiting in this driver; its send window full) and, from a
second local caller, realtime requests one at a time, open loop at ``--rate`` (a region's page renders
beside its prefetch). Reported per setting: the realtime requests' latency from their scheduled send time
to their answer at the caller (pooled over the repeats), how many were answered OK and how many were not
(refused at the intake, or not answered within the caller's 5 s deadline), and the batch requests Hong
Kong accepted per second. Loopback only (re-run inside ``unshare --net`` as root); every loop is bounded
in count and time.
``--write`` puts the table into docs/BENCHMARKS.md (section ``agent-reserve``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.agent_bench import accepted, feed, running_agent
from bench.gateway_bench import start_gateway
from bench.netns import reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb

SIMULATED = "simulated_call_s = 0.005\nsimulated_row_s = 0.0002"
RESERVES = (16, 0)
DEADLINE_S = 5.0


@dataclass
class Setting:
    """One reserve's runs, pooled."""

    reserve: int
    max_inflight: int
    latencies_ms: list[float] = field(default_factory=list)
    ok: int = 0
    not_ok: int = 0
    flood_accepted: float = 0.0
    seconds: float = 0.0


async def realtime(intake: str, requests: list[pb.InferRequest], rate: float, seconds: float) -> list[float]:
    """Realtime requests at ``rate``/s for ``seconds`` (open loop, each awaited in a task of its own); each
    one's latency in ms from its scheduled time, NaN when its answer is not OK."""
    out: list[float] = []

    async def one(request: pb.InferRequest, at: float) -> None:
        response = await client.infer(request, deadline_s=DEADLINE_S, priority=pb.PRIORITY_CLASS_REALTIME)
        out.append((time.monotonic() - at) * 1e3 if response.status == pb.STATUS_OK else float("nan"))

    async with EdgeClient(intake, service="page") as client:
        start = time.monotonic()
        tasks = []
        for i in range(int(rate * seconds)):
            at = start + i / rate
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            request = pb.InferRequest()
            request.CopyFrom(requests[i % len(requests)])
            request.request_id = b""
            request.priority = pb.PRIORITY_CLASS_REALTIME
            tasks.append(asyncio.create_task(one(request, at)))
        await asyncio.wait(tasks, timeout=DEADLINE_S + 5.0)
    return out


async def both(
    intake: str, flood: list[pb.InferRequest], lone: list[pb.InferRequest], rate: float, seconds: float
) -> list[float]:
    """The flood (from the first second on) and the realtime requests after it, side by side."""
    flooding = asyncio.create_task(feed(intake, flood, seconds + 1.0))
    await asyncio.sleep(1.0)  # the agent fills
    latencies = await realtime(intake, lone, rate, seconds)
    await flooding
    return latencies


def run(
    work: Path,
    gateway: tuple[int, str],
    setting: Setting,
    max_inflight: int,
    rate: float,
    seconds: float,
    flood: list[pb.InferRequest],
    lone: list[pb.InferRequest],
    tag: str,
) -> None:
    http_port, endpoint = gateway
    with running_agent(
        work, tag, endpoint, 100, 2.0, max_inflight=max_inflight, realtime_reserve=setting.reserve
    ) as (intake, _):
        before, _ = accepted(http_port)
        started = time.monotonic()
        latencies = asyncio.run(both(intake, flood, lone, rate, seconds))
        elapsed = time.monotonic() - started
        after, _ = accepted(http_port)
    answered = [x for x in latencies if not math.isnan(x)]
    setting.latencies_ms += answered
    setting.ok += len(answered)
    setting.not_ok += int(rate * seconds) - len(answered)
    setting.flood_accepted += after - before - len(answered)
    setting.seconds += elapsed


def render(settings: list[Setting], args: argparse.Namespace) -> str:
    rows = []
    for s in settings:
        lat = np.array(s.latencies_ms) if s.latencies_ms else np.array([float("nan")])
        p50, p90, p99 = (float(np.percentile(lat, q)) for q in (50, 90, 99))
        rows.append(
            [
                f"{s.max_inflight:,}",
                str(s.reserve),
                f"{s.ok:,} / {s.not_ok:,}",
                f"{p50:.1f}",
                f"{p90:.1f}",
                f"{p99:.1f}",
                f"{float(np.max(lat)):.1f}",
                f"{s.flood_accepted / max(s.seconds, 1e-9):,.0f}",
            ]
        )
    command = (
        f"python -m bench.agent_reserve --seconds {args.seconds:g} --repeats {args.repeats} "
        f"--rate {args.rate:g} --max-inflight {' '.join(str(m) for m in args.max_inflight)} "
        f"--queue-depth {args.queue_depth}"
        f"{' --write' if args.write else ''}"
    )
    return "\n".join(
        [
            "## An agent's realtime requests beside its own batch flood filling it (agent "
            "`[uplink] realtime_reserve`)",
            "",
            f"`{command}` ({stamp()}; {machine()}).",
            f"One gateway (null backend, a simulated device: 5 ms a call plus 0.2 ms a row, so Hong Kong "
            f"bounds the flood; a GPU cannot run here; pool queues of {args.queue_depth}, so it refuses "
            f"the flood's excess and the agent's send window halves); in turns an agent with "
            f"`realtime_reserve` {' and '.join(str(r) for r in RESERVES)}, for each `max_inflight` (what it "
            f"holds for Hong Kong: 65,536, the default, is more than the driver keeps waiting, so the send "
            f"window is the bound; 1,024 less, so the intake is full too), fed batch requests as fast as "
            f"it takes them (at most 2,000 waiting in the driver; its send window full) and, from a second "
            f"local caller, realtime requests one at a time, open loop at {args.rate:g}/s for "
            f"{args.seconds:g} s, {args.repeats} time(s) each. Latency: from a request's scheduled time "
            f"to its answer at the caller; not OK: refused at the intake, or not answered OK within the "
            f"caller's {DEADLINE_S:g} s deadline.",
            "",
            table(
                [
                    "max_inflight",
                    "realtime_reserve",
                    "realtime OK / not OK",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "max ms",
                    "batch requests accepted/s",
                ],
                rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rate", type=float, default=50.0, help="realtime requests per second")
    parser.add_argument(
        "--max-inflight", type=int, nargs="+", default=[65536, 1024], help="the agent's max_inflight(s)"
    )
    parser.add_argument("--queue-depth", type=int, default=256, help="each pool's max_queue_depth")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.agent_reserve", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    traffic = [r.request for r in SyntheticTraffic(4, regions=("us-west",)).take(3000)]
    flood = [r for r in traffic if r.kind != pb.REQUEST_KIND_IMAGE]
    lone = [r for r in traffic if r.kind == pb.REQUEST_KIND_RANKING][:200]
    settings = [Setting(reserve, most) for most in args.max_inflight for reserve in RESERVES]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        gateway = start_gateway(work, "null", backend_options=SIMULATED, max_queue_depth=args.queue_depth)
        try:
            for repeat in range(args.repeats):
                order = settings if repeat % 2 == 0 else settings[::-1]
                for setting in order:
                    run(
                        work,
                        (gateway.http_port, gateway.endpoint),
                        setting,
                        setting.max_inflight,
                        args.rate,
                        args.seconds,
                        flood,
                        lone,
                        f"{setting.max_inflight}-{setting.reserve}-{repeat}",
                    )
                    print(
                        f"[agent_reserve {time.strftime('%H:%M:%S')}] max_inflight {setting.max_inflight}, "
                        f"reserve {setting.reserve}, "
                        f"repeat {repeat + 1}",
                        file=sys.stderr,
                        flush=True,
                    )
        finally:
            gateway.close()
    report = render(settings, args)
    print(report)
    if args.write:
        update_section("agent-reserve", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
