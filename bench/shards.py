"""Issue 25's gauge: one gateway with ``shards = 1`` against one with ``shards = 2``, both in one run.

    python -m bench.shards [--seconds 12] [--repeats 6] [--write]

Both gateways run side by side on this checkout with the null backend and the same config file
(bench/gateway_bench.py's ``start_gateway``); the only difference is the top-level ``shards``, given as
``HKGW_SHARDS`` (the config's environment layer: ``start_gateway``'s extra TOML lands after its tables,
where a top-level key cannot go). With 2 shards ``python -m gateway`` is the front (it binds the carrier,
forwards each frame raw to shard crc32(agent id) % 2 over an ipc link) and two shard processes, each the
whole gateway with its forkserver and CPU worker; with 1 it is the single process and its workers.

Frames: bench/frame_path.py's, the previous issue's figures' (100 mixed requests: 60 ranking requests of 8-32
candidates, 40 short text queries, shuffled, a fixed seed), encoded before each run and sent round robin from
8 agent ids (``bench-0`` ... ``bench-7``; placement.shard_of puts 4 on each shard, checked at start), 8 frames
in flight (bench/ingest_bench.py's ``ingest``). The two gateways take turns in each repeat (1 shard first in
even repeats), the other one idle meanwhile.

Per gateway: records/s; CPU per record answered over its whole process tree (the front, the shards, their
forkservers and workers: every descendant, /proc walked recursively), the front's main process on its own
(and its event loop thread), each shard's subtree (which shows both shards worked); the cores the tree used;
the driver's own CPU (this process); and the 2-shard / 1-shard ratios. On a machine with few cores the driver
and the gateway share them, so the rate ratio is bounded by the machine; CPU per record is the figure to
compare. A projection for 16 cores from the measured per-record cost closes the section, labelled as one.

Everything runs on loopback (re-run inside ``unshare --net`` as root), every loop is bounded in count and
time, and ``--write`` puts the section into docs/BENCHMARKS.md (``shards``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Final

from bench import frame_path
from bench.frame_path import (
    AGENTS,
    FRAME,
    MAX_FRAMES,
    Cpu,
    Tree,
    Watch,
    attempt,
    frames_for,
    mixed_requests,
    spread,
    start_tree,
    statuses,
    thread_seconds,
    turns,
)
from bench.gateway_bench import Peer, cpu_seconds, process_tree
from bench.ingest_bench import ingest, prebuild
from bench.netns import REPO, reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edgewire import pb
from gateway.shards.placement import cores, default_shards, default_workers, shard_of

COUNTS: Final = (1, 2)
"""The shard counts compared: the single process and two shards behind a front."""
GOAL_CPU_RATIO: Final = 1.15  # CPU per record, 2 shards over 1
GOAL_RATE_RATIO: Final = 1.7  # records/s, 2 shards over 1, where the driver does not need the cores
PROJECTED_CORES: Final = 16
WARM_FRAMES: Final = 60
WARM_SECONDS: Final = 2.0


# ------------------------------------------------------------------ the gateways


def log(message: str) -> None:
    print(f"[shards {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def label(count: int) -> str:
    return f"{count} shard{'s' if count > 1 else ''}"


@contextmanager
def shards_env(count: int) -> Iterator[None]:
    """``HKGW_SHARDS`` set for the processes started inside (the config's top-level ``shards``)."""
    before = os.environ.get("HKGW_SHARDS")
    os.environ["HKGW_SHARDS"] = str(count)
    try:
        yield
    finally:
        if before is None:
            del os.environ["HKGW_SHARDS"]
        else:
            os.environ["HKGW_SHARDS"] = before


def start(count: int, work: Path) -> Peer:
    with shards_env(count):
        return start_tree(Tree(label(count), REPO), work / f"shards-{count}")


def shard_pids(peer: Peer) -> dict[int, int]:
    """Each shard's index and pid, from the command lines of the front's descendants (``shard --index N``);
    empty for the single process."""
    out: dict[int, int] = {}
    for pid in process_tree(peer.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "shard" in argv and "--index" in argv:
            out[int(argv[argv.index("--index") + 1])] = pid
    return out


def agent_split(agents: int = AGENTS, shards: int = 2) -> Counter[int]:
    """How many of the driver's agent ids (``bench-0`` ...) each shard serves."""
    return Counter(shard_of(f"bench-{i}", shards) for i in range(agents))


def shard_seconds(pid: int) -> tuple[float, float, float]:
    """CPU seconds of a shard's subtree (it, its forkserver and workers), of its own process and of that
    process's Python threads (all but ZeroMQ's I/O threads: the event loop, the inline CPU stage, ... under
    one GIL)."""
    total, by_role = cpu_seconds(pid)
    main = by_role.get("main process", 0.0)
    return total, main, main - Cpu(threads=thread_seconds(pid)).thread_group("zeromq")


# ------------------------------------------------------------------ runs


@dataclass
class Run:
    """One closed-loop run over pre-encoded frames of 100, against one gateway."""

    records: int
    refused: int
    seconds: float
    cpu: Cpu
    driver_s: float
    idle_cores: float
    foreign_cores: float
    processes: int
    shard_cpu: dict[int, float] = field(default_factory=dict)  # each shard's subtree, CPU seconds
    shard_main: dict[int, float] = field(default_factory=dict)  # each shard's own process, CPU seconds
    shard_python: dict[int, float] = field(default_factory=dict)  # of it its Python threads (one GIL)
    frames_by_shard: dict[int, int] = field(default_factory=dict)  # frames sent, by placement.shard_of

    @property
    def rate(self) -> float:
        return self.records / self.seconds


def timed_run(peer: Peer, idle: Sequence[Peer], frames: list[list[bytes]], seconds: float) -> Run:
    """One run of ``frames`` (at most ``seconds``): the gateway's tree, its shards' subtrees and the
    driver's CPU over it."""
    pids = shard_pids(peer)
    before = {i: shard_seconds(pid) for i, pid in pids.items()}
    processes = len(process_tree(peer.proc.pid))
    with Watch(peer, idle) as watch:
        driver = time.process_time()
        run = ingest(peer, frames, seconds)
        driver = time.process_time() - driver
    sent = frames[: math.ceil((run["answered"] + run["refused"]) / FRAME)]
    by_shard = Counter(shard_of(pb.Envelope.FromString(f[0]).agent_id, len(pids) or 1) for f in sent)
    if shard_pids(peer) != pids:
        raise RuntimeError(f"a shard was restarted during the run: {pids} -> {shard_pids(peer)}")
    after = {i: shard_seconds(pid) for i, pid in pids.items()}
    return Run(
        run["answered"],
        run["refused"],
        run["seconds"],
        watch.cpu,
        driver,
        watch.idle_cores,
        watch.foreign_cores,
        processes,
        {i: after[i][0] - before[i][0] for i in pids},
        {i: after[i][1] - before[i][1] for i in pids},
        {i: after[i][2] - before[i][2] for i in pids},
        dict(by_shard),
    )


@dataclass
class Results(frame_path.Results):
    """frame_path's (failures, answers by gateway label, the run's seconds) and this bench's runs."""

    runs: dict[int, list[Run]] = field(default_factory=dict)


def measure(seconds: float, repeats: int) -> Results:
    """Both gateways up side by side; warm-up, an answer check, then ``repeats`` turns each."""
    started = time.perf_counter()
    results = Results(runs={n: [] for n in COUNTS})
    requests = mixed_requests(seed=24)
    trees = [Tree(label(n), REPO) for n in COUNTS]
    by_label = dict(zip((t.label for t in trees), COUNTS, strict=True))
    peers: dict[int, Peer] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for n in COUNTS:
                peers[n] = start(n, Path(tmp))
                log(f"{label(n)} up: {len(process_tree(peers[n].proc.pid))} processes")
            others = {n: [p for m, p in peers.items() if m != n] for n in COUNTS}
            estimate: dict[int, float] = {}
            for n in COUNTS:
                frames = spread(prebuild(requests, WARM_FRAMES))
                warm = attempt(
                    results,
                    f"warm-up {label(n)}",
                    peers[n],
                    partial(timed_run, peers[n], others[n], frames, WARM_SECONDS),
                )
                estimate[n] = warm.rate if warm is not None else 1000.0
                results.answers[label(n)] = statuses(peers[n], spread(prebuild(requests, AGENTS)))
            log(f"warmed up: {', '.join(f'{label(n)} {r:,.0f}/s' for n, r in estimate.items())}")
            for repeat in range(repeats):
                for tree in turns(trees, repeat):
                    n = by_label[tree.label]
                    count = frames_for(estimate[n], seconds, FRAME, MAX_FRAMES)
                    frames = spread(prebuild(requests, count))
                    run = attempt(
                        results,
                        f"repeat {repeat + 1} {tree.label}",
                        peers[n],
                        partial(timed_run, peers[n], others[n], frames, seconds),
                    )
                    if run is None:
                        continue
                    estimate[n] = max(estimate[n], run.rate)
                    results.runs[n].append(run)
                    log(
                        f"repeat {repeat + 1} {tree.label}: {run.rate:,.0f} records/s, "
                        f"{run.cpu.tree / max(run.records, 1) * 1e6:.0f} us CPU per record ({count} frames)"
                    )
        finally:
            for peer in peers.values():
                peer.close()
    results.seconds = time.perf_counter() - started
    return results


# ------------------------------------------------------------------ figures


def _us(seconds: float, count: int) -> float:
    return seconds / count * 1e6 if count else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _per_s(us: float) -> float:
    """Records/s one core carries at ``us`` of CPU per record."""
    return _ratio(1e6, us)


@dataclass
class Figures:
    """One gateway's figures, pooled over its runs (CPU per record: all CPU over all records)."""

    rate: float
    rates: list[float]
    tree_us: float
    tree_us_runs: list[float]
    front_us: float  # the front's main process (2 shards); the gateway's main process (1 shard)
    front_python_us: float  # of it its Python threads (all but ZeroMQ's I/O threads: one GIL)
    below_us: float  # everything below the front: shards, forkservers, workers (1 shard: the whole tree)
    shard_main_us: float  # the shards' own processes, together (1 shard: the gateway's main process)
    shard_python_us: float  # of it their Python threads
    cores: float
    driver_cores: float
    driver_us: float
    foreign_cores: float
    idle_cores: float
    processes: int
    shard_cores: dict[int, float]
    frames_by_shard: dict[int, int]
    refused: int

    @property
    def workers_us(self) -> float:
        """The shards' forkservers and CPU workers."""
        return max(0.0, self.below_us - self.shard_main_us)


def figures(runs: Sequence[Run], sharded: bool) -> Figures:
    cpu = sum((r.cpu for r in runs), Cpu())
    records = sum(r.records for r in runs)
    seconds = sum(r.seconds for r in runs)
    shard_cpu: Counter[int] = Counter()
    frames: Counter[int] = Counter()
    for r in runs:
        shard_cpu.update(r.shard_cpu)
        frames.update(r.frames_by_shard)
    shard_main = sum(sum(r.shard_main.values()) for r in runs) if sharded else cpu.main
    python = cpu.main - cpu.thread_group("zeromq")
    shard_python = sum(sum(r.shard_python.values()) for r in runs) if sharded else python
    nan = float("nan")
    return Figures(
        rate=statistics.median(r.rate for r in runs) if runs else nan,
        rates=[r.rate for r in runs],
        tree_us=_us(cpu.tree, records),
        tree_us_runs=[_us(r.cpu.tree, r.records) for r in runs],
        front_us=_us(cpu.main, records),
        front_python_us=_us(python, records),
        below_us=_us(cpu.children if sharded else cpu.tree, records),
        shard_main_us=_us(shard_main, records),
        shard_python_us=_us(shard_python, records),
        cores=_ratio(cpu.tree, seconds),
        driver_cores=_ratio(sum(r.driver_s for r in runs), seconds),
        driver_us=_us(sum(r.driver_s for r in runs), records),
        foreign_cores=statistics.fmean(r.foreign_cores for r in runs) if runs else nan,
        idle_cores=max((r.idle_cores for r in runs), default=nan),
        processes=max((r.processes for r in runs), default=0),
        shard_cores={i: _ratio(v, seconds) for i, v in sorted(shard_cpu.items())},
        frames_by_shard=dict(sorted(frames.items())),
        refused=sum(r.refused for r in runs),
    )


def _each(values: Sequence[float], fmt: str) -> str:
    return " / ".join(format(v, fmt) for v in values)


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _row(
    name: str, one: str = "", two: str = "", ratio: str = "", goal: str = "", met: str = ""
) -> list[str]:
    return [name, one, two, ratio, goal, met]


def machine_bound(f: Figures, machine_cores: int) -> float:
    """Records/s the cores that the driver and processes outside this benchmark leave carry at ``f``'s
    CPU per record: what this machine allows that gateway, whatever its shards."""
    return _ratio(machine_cores - f.driver_cores - f.foreign_cores, f.tree_us * 1e-6)


def with_cores_to_spare(f: Figures, shards: int) -> float:
    """Records/s with a core free for each of the tree's Python threads' GILs (the driver elsewhere):
    the lowest of ``shards`` loops at their Python threads' CPU per record (agents split evenly) and, with a
    front, the front's. Derived from CPU per record, not measured as a rate."""
    by_shards = shards * _per_s(f.shard_python_us)
    return min(by_shards, _per_s(f.front_python_us)) if shards > 1 else by_shards


def table_rows(one: Figures, two: Figures, machine_cores: int) -> list[list[str]]:
    cpu_ratio = _ratio(two.tree_us, one.tree_us)
    rate_ratio = _ratio(two.rate, one.rate)
    bound = [machine_bound(f, machine_cores) for f in (one, two)]
    spare = [with_cores_to_spare(one, 1), with_cores_to_spare(two, 2)]
    spare_ratio = _ratio(spare[1], spare[0])
    return [
        _row(
            "records/s (median; each run, k)",
            f"{one.rate:,.0f} ({_each([r / 1e3 for r in one.rates], '.1f')})",
            f"{two.rate:,.0f} ({_each([r / 1e3 for r in two.rates], '.1f')})",
            f"{rate_ratio:.2f}x",
            f">= {GOAL_RATE_RATIO:g}x where the driver does not need the cores",
            "met, even on this machine"
            if rate_ratio >= GOAL_RATE_RATIO
            else "not met as measured (bounded by this machine's cores: see the last two rows)",
        ),
        _row(
            "gateway CPU per record, whole process tree, us (pooled; each run)",
            f"{one.tree_us:.1f} ({_each(one.tree_us_runs, '.0f')})",
            f"{two.tree_us:.1f} ({_each(two.tree_us_runs, '.0f')})",
            f"{cpu_ratio:.3f}x",
            f"<= {GOAL_CPU_RATIO:g}x",
            _met(cpu_ratio <= GOAL_CPU_RATIO),
        ),
        _row("- the front's main process (all its threads), us", "-", f"{two.front_us:.1f}"),
        _row(
            "-- of it its Python threads (one GIL; the rest is ZeroMQ's I/O), us",
            "-",
            f"{two.front_python_us:.1f}",
        ),
        _row(
            "- the shards, forkservers and workers (1 shard: the whole tree), us",
            f"{one.below_us:.1f}",
            f"{two.below_us:.1f}",
            f"{_ratio(two.below_us, one.below_us):.3f}x",
        ),
        _row(
            "-- of it the shards' own processes (1 shard: the gateway's), us",
            f"{one.shard_main_us:.1f}",
            f"{two.shard_main_us:.1f}",
            f"{_ratio(two.shard_main_us, one.shard_main_us):.3f}x",
        ),
        _row(
            "--- of it their Python threads (loop, inline CPU stage: one GIL each), us",
            f"{one.shard_python_us:.1f}",
            f"{two.shard_python_us:.1f}",
            f"{_ratio(two.shard_python_us, one.shard_python_us):.3f}x",
        ),
        _row(
            "-- of it their forkservers and CPU workers, us", f"{one.workers_us:.1f}", f"{two.workers_us:.1f}"
        ),
        _row("cores used by the gateway's process tree", f"{one.cores:.2f}", f"{two.cores:.2f}"),
        _row(
            "- of them by each shard's subtree",
            "-",
            ", ".join(f"shard {i}: {c:.2f}" for i, c in two.shard_cores.items()),
        ),
        _row("processes in the tree", f"{one.processes}", f"{two.processes}"),
        _row(
            "frames sent, by placement.shard_of of their agent id",
            "-",
            ", ".join(f"shard {i}: {n:,}" for i, n in two.frames_by_shard.items()),
        ),
        _row(
            "the driver (this process): cores; CPU per record, us",
            f"{one.driver_cores:.2f}; {one.driver_us:.1f}",
            f"{two.driver_cores:.2f}; {two.driver_us:.1f}",
        ),
        _row(
            "cores used outside this benchmark during the runs (mean)",
            f"{one.foreign_cores:.2f}",
            f"{two.foreign_cores:.2f}",
        ),
        _row(
            f"records/s the {machine_cores} cores carry at that CPU per record, less the driver and others",
            f"{bound[0]:,.0f}",
            f"{bound[1]:,.0f}",
            f"{_ratio(bound[1], bound[0]):.2f}x",
        ),
        _row(
            "records/s with cores to spare (derived, not measured: each GIL's bound, 1 / its Python threads' "
            "CPU per record; 2 shards: twice a shard's, or the front's if lower)",
            f"{spare[0]:,.0f}",
            f"{spare[1]:,.0f}",
            f"{spare_ratio:.2f}x",
            f">= {GOAL_RATE_RATIO:g}x where the driver does not need the cores",
            f"{_met(spare_ratio >= GOAL_RATE_RATIO)} (derived)",
        ),
    ]


def projection(one: Figures, two: Figures) -> str:
    """Records/s at 16 cores with the default shard count, from the measured per-record costs."""
    shards = default_shards(PROJECTED_CORES)
    workers = default_workers(PROJECTED_CORES, shards)
    usable = min(PROJECTED_CORES - 1, shards * (1 + workers))  # one core is the front's
    by_cores = usable / (two.below_us * 1e-6)
    by_gil = shards * _per_s(two.shard_python_us)
    by_front = _per_s(two.front_python_us)
    projected = min(by_cores, by_gil, by_front)
    return f"""**Projection, not a measurement.** At {PROJECTED_CORES} cores with default shards
(`placement.default_shards({PROJECTED_CORES})` = {shards}, `default_workers` = {workers} CPU worker(s) each),
{usable} cores are usable by shards (each shard's event loop and its workers; one core is the front's):

- records/s = cores usable by shards / CPU per record = {usable} / {two.below_us:.1f} us (the shards' share of
  the measured 2-shard cost per record) = {by_cores:,.0f};
- but a shard's Python threads (its event loop and the inline CPU stage) share one GIL, about one core: at
  {two.shard_python_us:.1f} us per record they carry at most {_per_s(two.shard_python_us):,.0f} records/s a
  shard, {shards} shards {by_gil:,.0f} (what ran on the CPU workers here: {two.workers_us:.1f} us per record);
- and the front's Python threads are one GIL too: at {two.front_python_us:.1f} us per record they pass at
  most {by_front:,.0f} records/s ({two.front_us:.1f} us per record for its whole process, ZeroMQ's I/O
  thread included).

Projected: the lowest of the three, **{projected:,.0f} records/s** at {PROJECTED_CORES} cores. One process
(1 shard) is bound by its one GIL on any number of cores: {one.shard_python_us:.1f} us per record, at most
{_per_s(one.shard_python_us):,.0f} records/s ({one.rate:,.0f} measured here). The projection assumes the cost
per record measured here holds there: no memory-bandwidth or cache contention, agents spread evenly over the
shards, the driver on other machines."""


def render(results: Results, args: argparse.Namespace) -> str:
    one, two = figures(results.runs[1], False), figures(results.runs[2], True)
    machine_cores = cores()
    split = agent_split()
    failed = "".join(f"\n**Failed** (left out of the figures): {f}" for f in results.failures)
    answers = "; ".join(
        f"{name}: {', '.join(f'{k} {v}' for k, v in a.items())}" for name, a in results.answers.items()
    )
    idle = max(one.idle_cores, two.idle_cores)
    command = f"python -m bench.shards --seconds {args.seconds:g} --repeats {args.repeats} --write"
    header = ["figure", label(1), label(2), "2 / 1", "goal", "2 shards"]
    return f"""## Ingest shards: 1 against 2 (issue 25)

`{command}` ({stamp()}; {machine()}; the whole run {results.seconds / 60:.1f} min).
Two gateways on this checkout with the null backend and bench/gateway_bench.py's config, the same file for
both but for `shards` (1 or 2, as `HKGW_SHARDS`). The frames of issue 24's figures (100 mixed requests: 60
ranking of 8-32 candidates, 40 short text queries), encoded before each run, 8 frames in flight,
{args.repeats} run(s) of up to {args.seconds:g} s per gateway, the two taking turns, the other idle. The
driver sends round robin from {AGENTS} agent ids, which placement.shard_of splits {split[0]} / {split[1]} over
shards 0 / 1. CPU from /proc over each gateway's whole process tree (every descendant: the front, the shards,
their forkservers and CPU workers) per record answered; the driver's from its own process.

**This machine has {machine_cores} cores, and the driver, both gateways and everything else on it share
them**: the 2-shard tree alone runs {two.processes} processes. Its records/s is bounded by the machine, not
by the shards, so the rate ratio says little here and CPU per record is the figure to compare (measured per
record, not as a rate, the driver's use of the cores does not enter it). The last two rows put the two
together. The first: the records/s that the cores the driver and processes outside this benchmark leave
could carry at each tree's CPU per record, whatever the GILs. The second, what the issue's rate goal asks
(the driver off the gateway's cores): a shard's event loop and inline CPU stage share one GIL, so with cores
to spare a tree answers at most one GIL's worth per shard, 1 / (its Python threads' CPU per record), the
front's GIL bounding the 2-shard tree too. The 1-shard gateway reaches its bound here (compare the first
row); the 2-shard one would need about {two.tree_us * 1e-6 * with_cores_to_spare(two, 2):.1f} cores and
has {machine_cores} with the driver.

{table(header, table_rows(one, two, machine_cores))}

{projection(one, two)}

Refused in the runs: {label(1)} {one.refused:,}, {label(2)} {two.refused:,}. The idle gateway used at most
{idle:.2f} cores while the other was measured. Answers to {AGENTS} check frames per gateway after its
warm-up (the timed runs count envelopes): {answers}.
{failed}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="one run at most")
    parser.add_argument("--repeats", type=int, default=6, help="runs per gateway")
    parser.add_argument("--write", action="store_true", help="update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    code = reexec_in_namespace("bench.shards", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    split = agent_split()
    if len(split) < 2:
        raise SystemExit(f"the driver's {AGENTS} agent ids all land on one shard: {dict(split)}")
    results = measure(args.seconds, args.repeats)
    if not results.runs[1] or not results.runs[2]:
        print("\n".join(results.failures), file=sys.stderr)
        return 1
    report = render(results, args)
    print(report)
    if args.write:
        update_section("shards", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
