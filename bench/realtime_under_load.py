"""Lone realtime requests while other agents load the gateway with batched frames: old code against new.

    python -m bench.realtime_under_load [--old /tmp/old] [--new .] [--rate 500] [--seconds 5] [--repeats 2]
                                        [--load-nice 19] [--lone interactive --load-window 64
                                        --load-agents 1] [--simulated-call-ms 2
                                        --simulated-row-us 150] [--write]

Two gateways (null backend, bench/gateway_bench.py's config) run one at a time, ``--old`` (a checkout of the
code before a change, e.g. ``git worktree add /tmp/old HEAD``) and ``--new``, taking turns in each repeat.
For each: one realtime request per frame from agent ``bench``, open loop at ``--rate`` for ``--seconds``
(latency from each request's scheduled send time), first alone, then while a load process sends frames of
100 mixed requests (bench/frame_path.py's mix, fresh ids, from 8 other agent ids) with 8 frames in flight,
as fast as the gateway answers them; its requests are interactive and batch ones (the mix's realtime
requests made interactive), in frames whose envelope says interactive, as an agent marks a frame with its
most urgent request's class and, since 2026-12-06, sends realtime requests in frames of their own (a frame
with a realtime request is served as it is read, as before). The load process builds its frames before the
timed phase and runs at ``--load-nice`` (19: it takes only the CPU the gateway and the realtime driver
leave, as an agent on its own host would; 0: it competes for this machine's two cores). Where the gateway
reads realtime frames behind the load's (the old code), their queue grows for the whole phase: those
latencies grow with ``--seconds`` and are not a steady state. Reported per tree and phase: the realtime
latencies (pooled over the repeats), the gateway's own part of them (the answers' ``timing.total_us``:
from the frame's read to the reply: its wait in the backlog included since 2026-12-06, from its decode
before; a frame waiting unread in ZeroMQ is outside it), and the load's records/s.

``--lone interactive`` sends the lone requests as interactive ones (in interactive frames, which wait in
the ingest backlog as the load's do), and ``--load-window`` / ``--load-agents`` make the load one agent
with many frames in flight: how long one agent's frame waits behind another agent's frames in the backlog
(one frame of each agent waiting since 2026-12-06, all of them before).

``--simulated-call-ms`` / ``--simulated-row-us`` give the null backend a simulated model server (that long
per call plus that much per row, calls side by side: gateway/backends/null.py), so that the backend, not the
gateway's CPU, bounds the load and the pools' queues fill: how long one agent's request waits in a pool's
queue behind another agent's (first come first served before 2026-12-06's lanes; each batch shared by the
agents after). Both trees must know the options (the null backend has them since 2026-12-06).

``--queue-depth`` bounds each pool's queue (4096 by default): with a simulated device and one agent's
flood, the pools fill, and this shows what another agent's requests get then (refused OVERLOADED first
come first served; since 2026-12-06 (night) queued up to that agent's fair share, the flood's newest
pushed out: gateway/dispatch/admission.py). The load counts OK answers only; its refusals and the answers
OVERLOADED it got for requests pushed out are columns of their own.

``--own-flood`` makes the load the lone requests' own agent (agent ``bench``, on a second carrier, as an
agent connects to each of a gateway's carriers): every request of its frames, and the frames, batch, a
region's prefetch beside its page renders; every pool then takes every priority class (none is kept
for realtime requests, as bench/gateway_bench.py's mig pool is). With ``--queue-depth`` and a simulated
device the flood fills the pools, and this shows what the agent's own realtime requests get then
(refused OVERLOADED first, the agent being alone and so at its fair share; since 2026-12-06 (late),
queued in the place of its newest batch requests: gateway/dispatch/admission.py ``preempt``).

Loopback only (re-run inside ``unshare --net`` as root); every loop is bounded in count and time.
``--write`` puts the table into docs/BENCHMARKS.md (section ``realtime-under-load``, or
``interactive-beside-a-flood`` with ``--lone interactive``, ``beside-a-flood-slow-backend`` with a simulated
device, ``beside-a-flood-full-queues`` with ``--queue-depth``, ``beside-its-own-flood`` with ``--own-flood``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Final

import numpy as np
import zmq

from bench.frame_path import Lone, Tree, copies, lone_run, mixed_requests, settle, spread, start_tree, turns
from bench.gateway_bench import Peer
from bench.ingest_bench import prebuild
from bench.netns import REPO, reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edgewire import FrameCodec, pb

WINDOW: Final = 8  # the load's frames in flight (--load-window)
LONE: Final = {"realtime": pb.PRIORITY_CLASS_REALTIME, "interactive": pb.PRIORITY_CLASS_INTERACTIVE}
LOAD_RATE_MAX: Final = 40_000  # records/s the load's frames are built for (it stops when they run out)
QUEUE_DEPTH: Final = 4096  # each pool's max_queue_depth unless --queue-depth (bench/gateway_bench.py's)
LEAD_S: Final = 1.0  # the load runs this long before the realtime phase starts
OWN_CARRIER: Final = "pccw"  # --own-flood: the carrier the flood comes on (the lone requests: hgc)
SECOND_CARRIER: Final = f"""
[[carriers]]
name = "{OWN_CARRIER}"
bind = "tcp://127.0.0.1:*"
"""


@dataclass
class Phase:
    """The realtime requests of one phase of one tree, pooled over the repeats, and the load beside them."""

    latencies_ms: list[float] = field(default_factory=list)
    gateway_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)  # of the gateway's part, the wait in a pool's queue
    answered: int = 0
    lost: int = 0
    refused: int = 0
    load_records: int = 0  # answered OK
    load_refused: int = 0  # nacked
    load_pushed: int = 0  # answered OVERLOADED once accepted (pushed out of a full queue)
    load_seconds: float = 0.0


@dataclass(frozen=True)
class Load:
    """The load beside the lone requests: its process's nice value, its frames in flight, its agent ids;
    ``own``: the lone requests' agent's own batch flood instead (every request and frame batch, from the
    lone driver's agent id, on a second carrier: an agent's connections to one gateway, one per carrier)."""

    nice: int = 19
    window: int = WINDOW
    agents: int = 8
    own: bool = False


def load_agent(
    endpoint: str,
    frames: int,
    seconds: float,
    load: Load,
    ready: Event,
    go: Event,
    out: multiprocessing.Queue[tuple[int, int, int, float]],
) -> None:
    """A process: build ``frames`` frames of 100 (fresh ids, from ``load.agents`` agent ids in turn), say
    ready, then on ``go`` keep ``load.window`` of them in flight for ``seconds`` at most (or until they run
    out); put (requests answered OK, refused, answered OVERLOADED, seconds)."""
    os.nice(load.nice)
    requests = copies(mixed_requests(2, 40))
    for request in requests:  # a loading agent's traffic: interactive and batch, none realtime
        if load.own:
            request.priority = pb.PRIORITY_CLASS_BATCH
        elif request.priority == pb.PRIORITY_CLASS_REALTIME:
            request.priority = pb.PRIORITY_CLASS_INTERACTIVE
    # Encoded as INTERACTIVE frames: an agent's envelope names its most urgent request's class.
    built = prebuild(requests, frames)
    if load.own:  # the lone driver's agent ("bench", prebuild's), its prefetch in BATCH frames
        codec = FrameCodec()
        built = [
            codec.reframe(pb.Envelope.FromString(f[0]), f[1], priority=pb.PRIORITY_CLASS_BATCH) for f in built
        ]
    else:
        built = spread(built, load.agents)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    codec = FrameCodec()
    ready.set()
    go.wait(60)
    answered = refused = pushed = sent = in_flight = 0
    took = 0.0  # the timed part's seconds, once over
    start = time.monotonic()
    end = start + seconds
    try:
        while time.monotonic() < end:
            while in_flight < load.window * 100 and sent < len(built):
                sock.send_multipart(built[sent])
                sent += 1
                in_flight += 100
            if not in_flight or not sock.poll(1000):
                break
            payload = codec.decode(sock.recv_multipart()).payload
            if isinstance(payload, pb.ResponseBatch):
                for response in payload.responses:
                    if response.status == pb.STATUS_OK:
                        answered += 1
                    elif response.status == pb.STATUS_OVERLOADED:
                        pushed += 1
                nacked = sum(len(ack.nacks) for ack in payload.acks)  # Acks riding with answers
                refused += nacked
                in_flight -= len(payload.responses) + nacked
            elif isinstance(payload, pb.Ack):
                refused += len(payload.nacks)
                in_flight -= len(payload.nacks)
        took = time.monotonic() - start
        # Its answers still coming are read (not counted) before the socket closes: the gateway would send
        # them on the agent's other route (the lone driver's, with --own-flood) once this one is gone.
        drain_end = time.monotonic() + 15.0
        while in_flight > 0 and time.monotonic() < drain_end and sock.poll(500):
            payload = codec.decode(sock.recv_multipart()).payload
            if isinstance(payload, pb.ResponseBatch):
                in_flight -= len(payload.responses) + sum(len(ack.nacks) for ack in payload.acks)
            elif isinstance(payload, pb.Ack):
                in_flight -= len(payload.nacks)
    finally:
        out.put((answered, refused, pushed, took or time.monotonic() - start))
        sock.close(0)
        ctx.term()


def loaded_run(
    peer: Peer,
    requests: list[pb.InferRequest],
    rate: float,
    seconds: float,
    load: Load,
    lone: pb.PriorityClass.ValueType,
    phase: Phase,
) -> None:
    """One run of lone requests (class ``lone``) while the load process loads ``peer``."""
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Event(), context.Event(), context.Queue()
    frames = int(LOAD_RATE_MAX * (seconds + LEAD_S + 1.0) / 100)
    endpoint = peer.endpoints[OWN_CARRIER] if load.own else peer.endpoint
    process = context.Process(
        target=load_agent, args=(endpoint, frames, seconds + LEAD_S, load, ready, go, out)
    )
    process.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the load process did not build its frames in 120 s")
        go.set()
        time.sleep(LEAD_S)
        run = lone_run(peer, [], requests, rate, seconds, lone)
        records, refused, pushed, took = out.get(timeout=seconds + 60)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    add(phase, run)
    phase.load_records += records
    phase.load_refused += refused
    phase.load_pushed += pushed
    phase.load_seconds += took


def add(phase: Phase, run: Lone) -> None:
    phase.latencies_ms += run.latencies_ms
    phase.gateway_ms += run.gateway_ms
    phase.queue_ms += run.queue_ms
    phase.answered += run.answered
    phase.lost += run.lost
    phase.refused += run.refused


def measure(
    trees: list[Tree],
    rate: float,
    seconds: float,
    repeats: int,
    load: Load,
    lone: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_REALTIME,
    backend_options: str = "",
    max_queue_depth: int = 4096,
) -> dict[str, dict[str, Phase]]:
    """Both trees, in turns per repeat (``backend_options``: TOML lines for the null backend's section;
    ``max_queue_depth``: each pool's)."""
    results = {t.label: {"alone": Phase(), "loaded": Phase()} for t in trees}
    requests = copies(mixed_requests(1, 4))
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for tree in turns(trees, repeat):
                peer = start_tree(
                    tree,
                    Path(tmp) / f"{tree.label}-{repeat}",
                    extra_toml=SECOND_CARRIER if load.own else "",
                    backend_options=backend_options,
                    max_queue_depth=max_queue_depth,
                    every_class=load.own,
                )
                try:
                    lone_run(peer, [], requests, rate, 1.0, lone)  # warm-up
                    add(results[tree.label]["alone"], lone_run(peer, [], requests, rate, seconds, lone))
                    loaded_run(peer, requests, rate, seconds, load, lone, results[tree.label]["loaded"])
                    settle(peer)
                finally:
                    peer.close()
                print(
                    f"[realtime_under_load {time.strftime('%H:%M:%S')}] {tree.label}, repeat {repeat + 1}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def render(results: dict[str, dict[str, Phase]], trees: list[Tree], args: argparse.Namespace) -> str:
    rows = []
    for tree in trees:
        for name in ("alone", "loaded"):
            p = results[tree.label][name]
            load = f"{p.load_records / p.load_seconds:,.0f}" if p.load_seconds else "-"
            shed = f"{p.load_refused:,} / {p.load_pushed:,}" if p.load_seconds else "-"
            rows.append(
                [
                    tree.label,
                    "alone" if name == "alone" else "beside the batched load",
                    f"{p.answered:,} / {p.refused:,} / {p.lost}",
                    f"{pct(p.latencies_ms, 50):.2f}",
                    f"{pct(p.latencies_ms, 90):.2f}",
                    f"{pct(p.latencies_ms, 99):.2f}",
                    f"{max(p.latencies_ms, default=float('nan')):.1f}",
                    f"{pct(p.gateway_ms, 50):.2f} / {pct(p.gateway_ms, 99):.2f}",
                    f"{pct(p.queue_ms, 50):.2f} / {pct(p.queue_ms, 99):.2f}",
                    load,
                    shed,
                ]
            )
    realtime = args.lone == "realtime"
    options = "" if realtime else f" --lone {args.lone}"
    if args.load_window != WINDOW or args.load_agents != Load.agents:
        options += f" --load-window {args.load_window}"
        if not args.own_flood:  # the lone requests' agent is the load's
            options += f" --load-agents {args.load_agents}"
    if args.own_flood:
        options += " --own-flood"
    if args.queue_depth != QUEUE_DEPTH:
        options += f" --queue-depth {args.queue_depth}"
    simulated = args.simulated_call_ms > 0 or args.simulated_row_us > 0
    device = ""
    if simulated:
        options += (
            f" --simulated-call-ms {args.simulated_call_ms:g} --simulated-row-us {args.simulated_row_us:g}"
        )
        device = (
            f" The null backend simulates a model server: each call takes {args.simulated_call_ms:g} ms plus "
            f"{args.simulated_row_us:g} us per row, waited without CPU, as many at once as a pool sends (8; "
            "a GPU cannot run here), so the backend bounds the load and the pools' queues fill."
        )
    agents = "1 other agent" if args.load_agents == 1 else f"{args.load_agents} other agents"
    load_is = f"interactive and batch requests in flight from {agents}"
    if args.own_flood:
        load_is = (
            "batch requests (frames marked batch) in flight from the lone requests' own agent, on a second "
            "carrier (one agent carries its region's page renders and its prefetch alike)"
        )
    if args.own_flood:
        title = "## An agent's realtime requests beside its own batch flood that fills the pools (priority)"
        device += (
            f" Each pool's queue holds {args.queue_depth} requests and takes every priority class (none "
            "kept for realtime requests), so the flood fills every pool that could take the lone requests."
        )
    elif args.queue_depth != QUEUE_DEPTH:
        title = "## One agent's requests beside another's flood that fills the pools (fair admission)"
        device += (
            f" Each pool's queue holds {args.queue_depth} requests, so the flood fills every pool that "
            "could take the lone requests."
        )
    elif simulated:
        title = "## One agent's requests beside another's flood, the backend the bound (issue 24: pool lanes)"
    elif realtime:
        title = "## Realtime requests beside a batched load (issue 24 item 2)"
    else:
        title = "## One agent's interactive requests beside another's flood of frames (issue 24: backlog)"
    return "\n".join(
        [
            title,
            "",
            f"`python -m bench.realtime_under_load --old {args.old} --rate {args.rate:g} "
            f"--seconds {args.seconds:g} --repeats {args.repeats} --load-nice {args.load_nice}{options} "
            f"--write` ({stamp()}; {machine()}).",
            f"Lone {args.lone} requests from one agent (one per frame), open loop, alone and while a load "
            f"process (nice {args.load_nice}) keeps {args.load_window} frames of 100",
            f"{load_is}; each tree in turn, latencies",
            "pooled over the repeats. The gateway's part: its answers' `timing.total_us`, from the frame's",
            "read to the reply (the old code: from its decode; a frame unread in ZeroMQ is outside it); of",
            "it, the wait in a pool's queue (the answers' `timing.queue_us`: its queueing to its batch)."
            + device,
            "",
            table(
                [
                    "tree",
                    f"{args.lone} requests",
                    "answered / refused / lost",
                    "p50 ms",
                    "p90 ms",
                    "p99 ms",
                    "max ms",
                    "gateway's part p50 / p99 ms",
                    "of it in a pool's queue p50 / p99 ms",
                    "load records/s (OK)",
                    "load refused / pushed out",
                ],
                rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, default=Path("/tmp/old"), help="checkout of the code before")
    parser.add_argument("--new", type=Path, default=REPO, help="checkout of the code after (this one)")
    parser.add_argument("--rate", type=float, default=500.0, help="realtime requests per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="one realtime phase")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--load-nice", type=int, default=19, choices=range(0, 20), metavar="0-19")
    parser.add_argument("--lone", choices=sorted(LONE), default="realtime", help="the lone requests' class")
    parser.add_argument("--load-window", type=int, default=WINDOW, help="the load's frames in flight")
    parser.add_argument("--load-agents", type=int, default=Load.agents, help="the load's agent ids")
    parser.add_argument("--simulated-call-ms", type=float, default=0.0, help="the null backend's call time")
    parser.add_argument("--simulated-row-us", type=float, default=0.0, help="... and its time per row")
    parser.add_argument("--queue-depth", type=int, default=QUEUE_DEPTH, help="each pool's max_queue_depth")
    parser.add_argument(
        "--own-flood", action="store_true", help="the load: the lone requests' own agent's batch requests"
    )
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    parser.add_argument("--dump", type=Path, help="write every latency (ms) per tree and phase as JSON")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.realtime_under_load", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    args.old, args.new = args.old.resolve(), args.new.resolve()
    trees = [Tree("old", args.old), Tree("new", args.new)]
    load = Load(args.load_nice, args.load_window, args.load_agents, args.own_flood)
    simulated = args.simulated_call_ms > 0 or args.simulated_row_us > 0
    call_s, row_s = args.simulated_call_ms / 1e3, args.simulated_row_us / 1e6
    backend_options = f"simulated_call_s = {call_s!r}\nsimulated_row_s = {row_s!r}" if simulated else ""
    results = measure(
        trees, args.rate, args.seconds, args.repeats, load, LONE[args.lone], backend_options, args.queue_depth
    )
    report = render(results, trees, args)
    print(report)
    if args.dump is not None:
        args.dump.write_text(
            json.dumps(
                {
                    tree: {
                        name: {
                            "latency_ms": ph.latencies_ms,
                            "gateway_ms": ph.gateway_ms,
                            "queue_ms": ph.queue_ms,
                        }
                        for name, ph in phases.items()
                    }
                    for tree, phases in results.items()
                }
            )
        )
    if args.write:
        if args.own_flood:
            section = "beside-its-own-flood"
        elif args.queue_depth != QUEUE_DEPTH:
            section = "beside-a-flood-full-queues"
        elif simulated:
            section = "beside-a-flood-slow-backend"
        elif args.lone == "realtime":
            section = "realtime-under-load"
        else:
            section = "interactive-beside-a-flood"
        update_section(section, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
