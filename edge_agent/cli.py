"""``edge-agent``: the regional agent's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

import structlog

from edge_agent.synthetic import PROFILES, SyntheticTraffic
from edgewire import labels
from routing.regions import REGIONS
from service.logs import LogFormat

log = structlog.get_logger("edge_agent")

KIND_NAMES = labels.REQUEST_KIND
PRIORITY_NAMES = labels.PRIORITY


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-agent",
        description="Regional edge agent of hk-edge-gateway: serves simple requests locally and ships the "
        "rest to the Hong Kong gateway.",
    )
    parser.add_argument("--region", help="this agent's region (see `edge-agent regions`)")
    parser.add_argument("--config", type=Path, help="TOML config (deploy/edge-agent.example.toml)")
    parser.add_argument("--intake", help="override intake (local endpoint for services)")
    parser.add_argument("--log-format", choices=get_args(LogFormat), help="override logging.format")
    parser.add_argument(
        "--synthetic", type=int, metavar="N", help="drive N synthetic requests, print a summary"
    )
    parser.add_argument("--rate", type=float, default=200.0, help="offered rate for --synthetic, requests/s")
    parser.add_argument("--json", action="store_true", help="with --synthetic: the summary as JSON")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("regions", help="list the built-in regions and their continents")
    check = sub.add_parser("check-config", help="validate an agent config file and exit")
    check.add_argument("path", type=Path)
    traffic = sub.add_parser("traffic", help="generate synthetic traffic and summarise it")
    traffic.add_argument("--requests", type=int, default=4000)
    traffic.add_argument("--seed", type=int, default=8)
    traffic.add_argument("--region", action="append", help="only this region (repeatable)")
    return parser


def traffic_summary(requests: int, seed: int, regions: Sequence[str] | None) -> str:
    """A table of what the synthetic generator produces: counts and payload sizes by region and kind."""
    generated = SyntheticTraffic(seed, regions=tuple(regions) if regions else None).take(requests)
    by_region_kind: Counter[tuple[str, str]] = Counter()
    bytes_by_kind: Counter[str] = Counter()
    by_priority: Counter[str] = Counter()
    for r in generated:
        kind = KIND_NAMES[r.request.kind]
        by_region_kind[(r.region, kind)] += 1
        bytes_by_kind[kind] += r.request.ByteSize()
        by_priority[PRIORITY_NAMES[r.request.priority]] += 1
    kinds = sorted(bytes_by_kind)
    lines = [
        f"synthetic traffic: {requests} requests, seed {seed}, {generated[-1].offset_s:.2f} s at 1000 req/s",
        "",
    ]
    lines.append(f"{'region':<16}" + "".join(f"{k:>10}" for k in kinds))
    for profile in PROFILES:
        if any(by_region_kind[(profile.name, k)] for k in kinds):
            lines.append(
                f"{profile.name:<16}" + "".join(f"{by_region_kind[(profile.name, k)]:>10}" for k in kinds)
            )
    kind_counts = Counter(k for (_, k) in by_region_kind.elements())
    lines.append(
        f"{'mean bytes':<16}" + "".join(f"{bytes_by_kind[k] // max(1, kind_counts[k]):>10}" for k in kinds)
    )
    lines.append("priority: " + ", ".join(f"{p} {n}" for p, n in sorted(by_priority.items())))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "regions":
        for region in REGIONS:
            print(f"{region.name:<16} {region.continent}  {region.description}")
        return 0
    if args.command == "check-config":
        from edge_agent.config import AgentConfigError, load_config

        try:
            config = load_config(args.path, environ={})
        except AgentConfigError as exc:
            for key, message in exc.problems:
                print(f"{args.path}: {key}: {message}", file=sys.stderr)
            return 2
        carriers = len(config.carriers)
        print(f"{args.path}: OK (agent {config.name}, region {config.region}, {carriers} static carriers)")
        return 0
    if args.command is None and (args.region or args.config):
        return _run(args)
    if args.command == "traffic":
        try:
            print(traffic_summary(args.requests, args.seed, args.region))
        except ValueError as exc:
            print(f"edge-agent: {exc}", file=sys.stderr)
            return 2
        return 0
    parser.print_help()
    return 0


def _run(args: argparse.Namespace) -> int:
    from edge_agent.config import AgentConfigError, load_config

    overrides: dict[str, Any] = {}
    if args.region:
        overrides["region"] = args.region
    if args.intake:
        overrides["intake"] = args.intake
    if args.log_format:
        overrides["logging"] = {"format": args.log_format}
    try:
        config = load_config(args.config, overrides=overrides)
    except AgentConfigError as exc:
        for key, message in exc.problems:
            print(f"edge-agent: config: {key}: {message}", file=sys.stderr)
        return 2
    from service.logs import configure_logging
    from service.runtime import run_main

    # Logs go to stderr (JSON off a terminal), so stdout carries only the --synthetic summary, which a
    # run's info lines would drown unless the config asks for them.
    logging = config.logging
    if args.synthetic and "level" not in logging.model_fields_set:
        logging = logging.model_copy(update={"level": "warning"})
    configure_logging(logging)
    return run_main(_serve(config, args))


async def _serve(config: Any, args: argparse.Namespace) -> int:
    """The agent's life (``EdgeAgent.serve``): until SIGTERM / SIGINT, or until the --synthetic run is
    answered. SIGHUP reloads; a second SIGINT exits at once, skipping the drain."""
    from edge_agent.agent import EdgeAgent
    from edge_agent.drive import drive
    from service.runtime import collect_young_less_often, freeze_startup_objects

    agent = EdgeAgent(config)
    stop = asyncio.Event()
    await agent.start()  # serve() starts it too; started first, the start-up heap can be frozen
    freeze_startup_objects()  # full collections no longer scan the start-up heap (service/runtime.py)
    collect_young_less_often()
    # What a supervisor (the demo, a test) reads to find this process's ports, like the gateway's
    # "gateway ready": the intake and HTTP ports chosen when the config asked for any free one.
    log.info(
        "agent ready",
        agent=config.name,
        region=config.region,
        pid=os.getpid(),
        intake=agent.intake_endpoint,
        http_port=agent.http.port if agent.http is not None else None,
        local_tier=agent.local is not None,
    )
    if args.synthetic:
        serving = asyncio.create_task(agent.serve(stop))
        try:
            result = await drive(agent.intake_endpoint, config.region, args.synthetic, args.rate)
        finally:
            stop.set()
            await serving
        print(json.dumps(result.as_dict()) if args.json else result.render())
        return 0 if result.lost == 0 else 1

    loop = asyncio.get_running_loop()

    def on_interrupt() -> None:
        if stop.is_set():  # a second Ctrl-C: skip the drain
            os._exit(130)
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, on_interrupt)
    loop.add_signal_handler(signal.SIGHUP, agent.reload, args.config)
    left = await agent.serve(stop)
    if left:
        print(
            f"edge-agent: stopped with {left} requests unanswered (spooled ones resend on start)",
            file=sys.stderr,
        )
    return 0
