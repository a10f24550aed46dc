"""One agent's decompression-bomb flood against another agent's latency, with the cost budget on and off.

    python -m bench.budget_attack [--seconds 8] [--rate 200] [--declared-mib 32] [--attacker-nice 0,19]
        [--write]

A gateway (its own process, null backend, loopback only) serves a *victim*: one realtime request per
frame at ``--rate``/s, open loop, each latency measured from the request's scheduled send time (a stall
is not hidden by coordinated omission). Its p50/p99 are measured unattacked, then while an *attacker*
(another process, its own connection and agent id) sends as fast as its socket takes them frames of
~1 KB of zstd that honestly declare ``--declared-mib`` MiB of zeros: every codec limit is kept, and each
frame that is decompressed costs the event loop tens of milliseconds. Both with ``[budget]`` at its
defaults and with ``enabled = false``, each on a fresh gateway. Bounded: ``--seconds`` per phase, the
attacker stops after ``--max-frames`` or when told, answers are waited for at most 10 s; a victim request
still unanswered then counts as infinitely late (its p99 reads ``> 10 s``).

``--attacker-nice``: the attacker's process runs at each of these nice values in turn. An attacker is a
remote agent and does not take the gateway host's CPU; on a machine of two cores a full-rate attacker at
normal priority takes one of them from the gateway, its ZeroMQ I/O thread and the victim's client, so its
nice 19 run is the closer model of the gateway's own behaviour, and its nice 0 run what this box does.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path

import zmq
import zstandard as zstd

from bench.gateway_bench import (
    GATEWAY_TOML,
    TICKS,
    Peer,
    Tracker,
    cpu_seconds,
    open_loop_drive,
    pools_toml,
    workload,
)
from bench.netns import reexec_in_namespace
from bench.report import machine, stamp, table, update_section
from edgewire import FrameCodec, new_id, now_unix_us, pb
from gateway.config import BudgetConfig
from gateway.shards.placement import shard_of

WAIT_S = 10.0  # the longest a victim request is waited for after the phase


@dataclass
class Phase:
    budget: str
    attack: str  # none, N/s or full rate
    attacker_nice: int  # the attacker process's nice value (0 also when there is no attacker)
    victim_sent: int
    victim_answered: int
    p50_ms: float
    p99_ms: float
    gateway_p50_ms: (
        float  # the answers' ServerTiming.total_us: the gateway's receipt of the request to its reply
    )
    gateway_p99_ms: float
    attack_frames: int  # sent by the attacker in the phase
    attack_decompressed: int  # of them, refused only after decompression (payload_invalid)
    attack_refused: int  # over_budget, before decompression
    loop_cpu: float  # the gateway's event-loop thread: CPU seconds per second of the phase
    machine_busy: float  # share of all this machine's cores busy in the phase (everything on it)


def bomb_body(declared: int) -> bytes:
    return zstd.ZstdCompressor(level=3, write_content_size=True).compress(bytes(declared))


def attacker(
    endpoint: str,
    declared: int,
    rate: float,
    max_frames: int,
    stop: Event,
    sent: Synchronized[int],
    nice: int = 0,
) -> None:
    """Send bombs on a DEALER at ``rate``/s (0: as fast as it takes them, blocking at its high-water mark),
    reading and dropping whatever comes back, until ``stop`` or ``max_frames``; at ``nice`` if not 0."""
    if nice:
        os.nice(nice)
    body = bomb_body(declared)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(endpoint)
    envelope = pb.Envelope(
        schema_version=1,
        agent_id="attacker",
        region="us-west",
        kind=pb.MESSAGE_KIND_REQUEST_BATCH,
        codec=pb.CODEC_ZSTD,
        uncompressed_length=declared,
    )
    n = 0
    start = time.perf_counter()
    try:
        while n < max_frames and not stop.is_set():
            if rate and (ahead := start + n / rate - time.perf_counter()) > 0:
                time.sleep(ahead)
            envelope.message_id = new_id()
            envelope.sent_at_unix_us = now_unix_us()
            try:
                sock.send_multipart([envelope.SerializeToString(), body], copy=False)
            except zmq.Again:
                continue
            n += 1
            if n % 64 == 0:
                sent.value = n
                while sock.poll(0):
                    sock.recv_multipart()
    finally:
        sent.value = n
        sock.close(0)
        ctx.term()


def budget_label(budget_enabled: bool, held_reads_per_s: float | None) -> str:
    """How a row names the gateway's ``[budget]``: its defaults, off, or the defaults but the held pace."""
    if not budget_enabled:
        return "off"
    if held_reads_per_s is None or held_reads_per_s == BudgetConfig().held_reads_per_s:
        return "defaults"
    return f"held_reads_per_s = {held_reads_per_s:g}"


def start_gateway(
    workdir: Path, budget_enabled: bool, held_reads_per_s: float | None = None, shards: int = 1
) -> Peer:
    """A gateway with the null backend and the bench pools (bench/gateway_bench.py's), one carrier;
    ``held_reads_per_s``: the budget's pace of held connections' frames (None: its default); ``shards``:
    the config's top-level ``shards`` (as ``HKGW_SHARDS``: more than 1 is a front and its shards)."""
    models = workdir / "models"
    if not models.exists():
        from inference.models.demo import write_demo_repository

        write_demo_repository(models)
    toml = GATEWAY_TOML.format(backend="null", models=models, backend_options="", pools=pools_toml())
    toml = toml.replace('level = "warning"', 'level = "info"')  # the ready line is logged at info
    toml += f"\n[budget]\nenabled = {'true' if budget_enabled else 'false'}\n"
    if held_reads_per_s is not None:
        toml += f"held_reads_per_s = {held_reads_per_s:g}\n"
    config = workdir / f"gateway-budget-{budget_enabled}-{held_reads_per_s}.toml"
    config.write_text(toml)
    return Peer(
        f"hk-gateway (budget {budget_label(budget_enabled, held_reads_per_s)}, shards {shards})",
        [sys.executable, "-m", "gateway", "--config", str(config)],
        ready="stderr",
        env={"HKGW_SHARDS": str(shards)},
    )


def gateway_cpu_s(pid: int, shards: int) -> float:
    """The CPU seconds the gauge counts: the single process's event-loop thread; with shards, the whole
    process tree (the front's relay thread reads every frame, the shards refuse them)."""
    return loop_cpu_s(pid) if shards <= 1 else cpu_seconds(pid)[0]


def loop_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (the gateway's event loop), from /proc."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def rejected(peer: Peer, tries: int = 5) -> dict[str, float]:
    """hkgw_frames_rejected_total by reason, from the gateway's /metrics. A gateway swamped by a flood with
    its budget off may reset the scrape's connection: asked again, up to ``tries`` times in all."""
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{peer.http_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if attempt == tries - 1:
                raise
            time.sleep(1.0)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hkgw_frames_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class VictimTracker(Tracker):
    """Also keeps what each answer says the gateway took (``timing.total_us``: from the request's receipt,
    decoded, to its reply), so that a latency can be split into the gateway's part and the rest (the
    ZeroMQ hops, the kernel, waiting for a core, the reader's turn before the frame was decoded)."""

    def __init__(self) -> None:
        super().__init__(FrameCodec(), is_gateway=True)
        self.gateway_s: list[float] = []

    def received(self, frames: list[bytes], at: float) -> None:
        super().received(frames, at)
        payload = self.codec.decode(frames).payload
        if isinstance(payload, pb.ResponseBatch):
            self.gateway_s.extend(r.timing.total_us / 1e6 for r in payload.responses)


def victim_id(shards: int, placement: str) -> str:
    """The victim's agent id: "victim", or with ``placement`` "same" and shards, the first "victim-N" that
    lands on the attacker's shard (gateway/shards/placement.py)."""
    if shards <= 1 or placement != "same":
        return "victim"
    target = shard_of("attacker", shards)
    return next(
        name for n in range(10_000) if shard_of(name := f"victim-{n}" if n else "victim", shards) == target
    )


def victim_phase(
    peer: Peer, requests: list[pb.InferRequest], rate: float, seconds: float, agent_id: str = "victim"
) -> tuple[int, list[float], list[float]]:
    """Open loop on the victim's DEALER; (requests sent, latencies in seconds, inf for unanswered, the
    gateway's part of each answered one)."""
    tracker = VictimTracker()
    open_loop_drive(peer, requests, rate, seconds, tracker, agent_id=agent_id, budget_s=30.0, wait_s=WAIT_S)
    total = int(rate * seconds)
    return total, tracker.latencies + [math.inf] * len(tracker.sent_at), tracker.gateway_s


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank), infinite values included: an unanswered request is the latest."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def run_pair(
    work: Path,
    budget_enabled: bool,
    attack_rate: float,
    args: argparse.Namespace,
    nice: int = 0,
    held_reads_per_s: float | None = None,
) -> tuple[Phase, Phase]:
    """On a fresh gateway: the victim unattacked, then attacked at ``attack_rate`` (0: full rate) by an
    attacker at ``nice``."""
    requests = workload(500, seed=5)
    peer = start_gateway(work, budget_enabled, held_reads_per_s, args.shards)
    phases = []
    try:
        label = budget_label(budget_enabled, held_reads_per_s)
        for attack in ("none", "full rate" if not attack_rate else f"{attack_rate:g}/s"):
            stop = mp.Event()
            sent: Synchronized[int] = mp.Value("l", 0)
            before = rejected(peer)
            proc = None
            if attack != "none":
                proc = mp.Process(
                    target=attacker,
                    args=(
                        peer.endpoint,
                        args.declared_mib << 20,
                        attack_rate,
                        args.max_frames,
                        stop,
                        sent,
                        nice,
                    ),
                    daemon=True,
                )
                proc.start()
                time.sleep(1.0)  # the flood under way (and the burst spent) before the victim is measured
            cpu_before, ticks_before, started = (
                gateway_cpu_s(peer.proc.pid, args.shards),
                machine_ticks(),
                time.perf_counter(),
            )
            total, lat, gateway_s = victim_phase(
                peer, requests, args.rate, args.seconds, victim_id(args.shards, args.victim_shard)
            )
            elapsed = time.perf_counter() - started
            loop_cpu = (gateway_cpu_s(peer.proc.pid, args.shards) - cpu_before) / elapsed
            ticks_after = machine_ticks()
            busy = (ticks_after[0] - ticks_before[0]) / max(1, ticks_after[1] - ticks_before[1])
            stop.set()
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            after = rejected(peer)
            ms = [x * 1000 for x in lat]
            phases.append(
                Phase(
                    label,
                    attack,
                    nice if attack != "none" else 0,
                    total,
                    sum(math.isfinite(x) for x in ms),
                    percentile(ms, 50),
                    percentile(ms, 99),
                    percentile([x * 1000 for x in gateway_s], 50) if gateway_s else math.nan,
                    percentile([x * 1000 for x in gateway_s], 99) if gateway_s else math.nan,
                    sent.value,
                    int(after.get("payload_invalid", 0) - before.get("payload_invalid", 0)),
                    int(after.get("over_budget", 0) - before.get("over_budget", 0)),
                    loop_cpu,
                    busy,
                )
            )
            print(f"{asdict(phases[-1])}", file=sys.stderr)
    finally:
        peer.close()
    return phases[0], phases[1]


def fmt_ms(value: float, digits: int = 1) -> str:
    """Milliseconds; inf is a request never answered, NaN a figure with nothing to measure (no answers)."""
    if math.isnan(value):
        return "n/a"
    return f"> {WAIT_S:.0f} s" if math.isinf(value) else f"{value:.{digits}f}"


def gateway_ratio(runs: list[tuple[Phase, Phase]]) -> str:
    """The median over the repeats of attacked / unattacked gateway's-part p99, of the repeats with both."""
    ratios = [
        a.gateway_p99_ms / b.gateway_p99_ms
        for b, a in runs
        if math.isfinite(a.gateway_p99_ms) and math.isfinite(b.gateway_p99_ms) and b.gateway_p99_ms > 0
    ]
    return f"{median(ratios):.1f}x" if ratios else "n/a"


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def render(pairs: list[tuple[Phase, Phase]], args: argparse.Namespace) -> str:
    """One row per budget setting and attack: medians over the repeats (each a fresh gateway measuring
    its own unattacked baseline first), and the range of the per-repeat p99 ratios."""
    groups: dict[tuple[str, str, int], list[tuple[Phase, Phase]]] = {}
    for base, attacked in pairs:
        key = (attacked.budget, attacked.attack, attacked.attacker_nice)
        groups.setdefault(key, []).append((base, attacked))
    rows = []
    for (budget, attack, nice), runs in groups.items():
        ratios = [a.p99_ms / b.p99_ms for b, a in runs]
        rows.append(
            [
                f"`[budget]` {budget}",
                attack,
                str(nice),
                fmt_ms(median([b.p99_ms for b, _ in runs])),
                fmt_ms(median([a.p50_ms for _, a in runs])),
                fmt_ms(median([a.p99_ms for _, a in runs])),
                "inf" if math.isinf(median(ratios)) else f"{median(ratios):.1f}x",
                ", ".join("inf" if math.isinf(r) else f"{r:.1f}x" for r in ratios),
                " / ".join(
                    fmt_ms(
                        median(
                            [p.gateway_p99_ms for p in side if not math.isnan(p.gateway_p99_ms)] or [math.nan]
                        ),
                        2,
                    )
                    for side in zip(*runs, strict=True)
                ),
                gateway_ratio(runs),
                f"{sum(a.victim_answered for _, a in runs):,} / {sum(a.victim_sent for _, a in runs):,}",
                f"{sum(a.attack_frames for _, a in runs) // len(runs):,}",
                f"{sum(a.attack_decompressed for _, a in runs) / len(runs):g}",
                f"{sum(a.attack_refused for _, a in runs) // len(runs):,}",
                " / ".join(f"{median([p.loop_cpu for p in side]):.2f}" for side in zip(*runs, strict=True)),
                " / ".join(
                    f"{median([p.machine_busy for p in side]):.0%}" for side in zip(*runs, strict=True)
                ),
            ]
        )
    header = [
        "gateway",
        "attack",
        "attacker nice",
        "victim p99 unattacked ms",
        "attacked p50 ms",
        "attacked p99 ms",
        "p99 / unattacked",
        "per repeat",
        "gateway's part p99 ms, unattacked / attacked",
        "gateway's part p99 / unattacked (median of repeats)",
        "victim answered",
        "bombs sent",
        "decompressed",
        "refused `over_budget`",
        "gateway loop CPU s/s, unattacked / attacked"
        if args.shards <= 1
        else "gateway process tree CPU s/s, unattacked / attacked",
        "machine busy, unattacked / attacked",
    ]
    rates = ",".join(f"{r:g}" for r in args.attack_rates)
    nices = ",".join(str(n) for n in args.attacker_nice)
    extra = "" if args.budgets == ["on", "off"] else f" --budgets {','.join(args.budgets)}"
    if args.held_reads_per_s:
        extra += f" --held-reads-per-s {','.join(f'{x:g}' for x in args.held_reads_per_s)}"
    title = "## Per-agent cost budget under a decompression-bomb flood (issue 24 item 4)"
    if args.shards > 1:
        extra += f" --shards {args.shards}"
        if args.victim_shard != "other":
            extra += f" --victim-shard {args.victim_shard}"
        title = (
            f"## Per-agent cost budget under a decompression-bomb flood, {args.shards} shards behind a front "
            "(issue 24 item 4)"
        )
    return (
        f"{title}\n\n"
        f"Command: `python -m bench.budget_attack --seconds {args.seconds:g} --rate {args.rate:g} "
        f"--attack-rates {rates} --attacker-nice {nices}{extra} --repeat {args.repeat} --write`  \n"
        f"Measured {stamp()} on {machine()}.\n\n"
        f"A victim agent sends one realtime request per frame, open loop at {args.rate:g}/s for "
        f"{args.seconds:g} s (latency from the scheduled send time; unanswered {WAIT_S:g} s after the "
        "phase = infinitely late). The attacker, another agent on its own connection and in its own process, "
        f"sends frames of {len(bomb_body(args.declared_mib << 20)):,} bytes of zstd that honestly declare "
        f"{args.declared_mib} MiB of zeros (each one decompressed is then refused `payload_invalid`), at a "
        "fixed rate or as fast as its socket takes them (full rate), from 1 s before the victim's phase to "
        "its end, its process at each 'attacker nice' value in turn. Each repeat is a fresh gateway (null "
        "backend, the bench pools) that measures the victim "
        f"unattacked first, then attacked; figures are medians over {args.repeat} repeats, counts are per "
        "repeat. Everything, the attacker included, shares this machine's cores with whatever else runs on "
        "it: an attacker is a remote agent that takes none of the gateway host's CPU, so at nice 19 it "
        "models that (it still runs, on what the gateway leaves), at nice 0 it takes a core the gateway "
        "would otherwise have.\n\n"
        + table(header, rows)
        + "\n\n'decompressed': attacker frames the gateway decompressed (then refused `payload_invalid`); "
        "with the budget a 32 MiB frame costs a GiB of the bytes bucket (refilled at `bytes_per_s`), so "
        "one every 4 s is (the first in the second before the victim's phase). "
        "'gateway's part': what the victim's answers say the gateway took (`timing.total_us`, from the "
        "request's receipt, decoded, to its reply); the rest of a victim's latency is the ZeroMQ hops both "
        "ways, the reader's turn before its frame is decoded, and waiting for a core (here the victim's "
        "client, the gateway's ZeroMQ I/O thread and the attacker share what the loop leaves). "
        "'gateway loop CPU': what the gateway's event-loop thread got "
        "per second of the phase; 'machine busy': all cores, whatever runs on them. At full rate the "
        "attacker keeps sending whatever is refused, so the gateway reads a frame, refuses it (no "
        "decompression, at most 64 Acks per hold), and its connection is then held: its frames are refused "
        "as soon as their envelope is read, and the carrier reads them at most `held_reads_per_s` a second "
        "(5,000 by default; a ROUTER reads its connections in turn, so its reader pauses: "
        "gateway/ingress/budget.py HeldReadPace), the rest waiting in ZeroMQ and the attacker's sends "
        "stopping at its high-water mark. `held_reads_per_s = 0` reads them as fast as they come: a frame's "
        "envelope must be read to know whose it is, so the flood then takes the loop."
        + shards_note(args.shards, args.victim_shard)
    )


def shards_note(shards: int, placement: str = "other") -> str:
    """What differs with shards: where the flood is read and refused, and what the CPU column counts."""
    if shards <= 1:
        return ""
    victim = victim_id(shards, placement)
    placed = {"victim": shard_of(victim, shards), "attacker": shard_of("attacker", shards)}
    return (
        f"\n\nWith {shards} shards (`HKGW_SHARDS={shards}`) `python -m gateway` is the front: its relay "
        "thread reads the carrier's ROUTER and passes each frame to its agent's shard "
        f"(here the victim's is shard {placed['victim']}, the attacker's shard {placed['attacker']}), "
        "where the budget refuses it and holds its connection; a shard tells the front of each hold, and "
        "the front then refuses the held connection's frames itself, reading them at `held_reads_per_s` "
        "(gateway/shards/holds.py). 'gateway process tree CPU' (in place of the loop's): the front, the "
        "shards and their workers together, per second of the phase."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="victim p99 under a bomb flood, cost budget on and off")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rate", type=float, default=200.0, help="the victim's open-loop requests/s")
    parser.add_argument(
        "--attack-rates",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[185.0, 0.0],
        help="bombs/s, comma-separated; 0 = full rate",
    )
    parser.add_argument(
        "--attacker-nice",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[0],
        help="the attacker process's nice values, comma-separated; each attack runs at each",
    )
    parser.add_argument(
        "--budgets",
        type=lambda text: text.split(","),
        default=["on", "off"],
        help="on, off or both: the gateway's [budget] enabled or not",
    )
    parser.add_argument(
        "--held-reads-per-s",
        type=lambda text: [float(x) for x in text.split(",")],
        default=None,
        help="with the budget on, each of these [budget] held_reads_per_s in turn (default: its default)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="the gateway's shards (more than 1: a front and its shards; written to its own section)",
    )
    parser.add_argument(
        "--victim-shard",
        choices=("other", "same"),
        default="other",
        help="with shards: the victim on another shard than the attacker's (agent id 'victim'), or the same",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--declared-mib", type=int, default=32)
    parser.add_argument("--max-frames", type=int, default=2_000_000)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.attacker_nice) < 0 and os.geteuid() != 0:
        parser.error("a negative --attacker-nice needs root (the attacker would die at its start)")
    code = reexec_in_namespace("bench.budget_attack", sys.argv[1:] if argv is None else argv)
    if code is not None:
        return code
    pairs: list[tuple[Phase, Phase]] = []
    with tempfile.TemporaryDirectory() as tmp:
        settings: list[tuple[bool, float | None]] = []
        if "on" in args.budgets:
            settings += [(True, pace) for pace in (args.held_reads_per_s or [None])]
        if "off" in args.budgets:
            settings.append((False, None))
        for _ in range(args.repeat):
            for enabled, pace in settings:
                for attack_rate in args.attack_rates:
                    for nice in args.attacker_nice:
                        base, attacked = run_pair(Path(tmp), enabled, attack_rate, args, nice, pace)
                        pairs.append((base, attacked))
    report = render(pairs, args)
    print(json.dumps([[asdict(b), asdict(a)] for b, a in pairs], indent=2) if args.json else report)
    if args.write:
        update_section("budget" if args.shards <= 1 else "budget-shards", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
