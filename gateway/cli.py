"""``hk-gateway``: the Hong Kong ingest daemon's command line.

hk-gateway                       run a local gateway (loopback carriers, embedded demo models)
hk-gateway --config PATH         run with a TOML config (deploy/hk-gateway.example.toml)
hk-gateway check-config PATH     validate a config and exit
hk-gateway keygen --out DIR      write CurveZMQ key pairs (the gateway's, or an agent's with --agent)
hk-gateway models init DIR       write the deterministic demo model repository (--triton gpu|cpu: for Triton)
hk-gateway capture inspect FILE  what capture files hold (counts by kind, region, carrier, model; corrupt)
hk-gateway replay FILE --to EP   re-send captured traffic (--speed, --ids, --record-decisions, --expect)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.config import DEFAULT_MODELS_DIR, ConfigError, GatewayConfig, load_config

if TYPE_CHECKING:
    from gateway.shards.link import ShardRole

EXIT_CONFIG = 2
EXIT_START = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hk-gateway",
        description="Hong Kong ingest gateway: terminates agent traffic on every carrier, routes it across "
        "tiers and backend pools, and answers the agents.",
    )
    parser.add_argument("--config", type=Path, help="TOML config file (default: built-in local gateway)")
    parser.add_argument("--http-port", type=int, help="override http.port")
    parser.add_argument("--shards", type=int, help="override shards (ingest processes; 0: from the cores)")
    parser.add_argument("--log-format", choices=["auto", "json", "console"], help="override logging.format")
    parser.add_argument(
        "--log-level", choices=["debug", "info", "warning", "error"], help="override logging.level"
    )
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("path", type=Path)
    keygen = sub.add_parser("keygen", help="write CurveZMQ key pairs")
    keygen.add_argument(
        "--out", type=Path, required=True, help="directory to write the .key/.key_secret into"
    )
    keygen.add_argument(
        "--agent", help="write an agent's key pair with this agent id (default: the gateway's)"
    )
    keygen.add_argument("--region", default="unknown", help="the agent's region (with --agent)")
    models = sub.add_parser("models", help="model repository tools")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    init = models_sub.add_parser("init", help="write the demo models in Triton's repository layout")
    init.add_argument("dir", type=Path)
    init.add_argument(
        "--triton",
        choices=["gpu", "cpu"],
        help="write configs for a Triton server (dynamic batching, priorities, queue policy) "
        "with GPU or CPU instances, instead of the embedded backend's",
    )
    init.add_argument(
        "--runtime",
        choices=["onnxruntime", "python"],
        default="onnxruntime",
        help="with --triton: Triton's onnxruntime backend, or the python-backend shim running ONNX Runtime",
    )
    init.add_argument("--versions", type=int, default=1, help="with --triton: versions 1..N of each model")
    capture = sub.add_parser("capture", help="traffic capture tools")
    capture_sub = capture.add_subparsers(dest="capture_command", required=True)
    inspect = capture_sub.add_parser("inspect", help="what capture files hold")
    inspect.add_argument("files", type=Path, nargs="+")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    bgp = sub.add_parser(
        "bgp-announcer", help="ExaBGP API process: announce one carrier's prefixes by its health (deploy/bgp)"
    )
    bgp.add_argument("--carrier", required=True, help="a [[carriers]] name that has a [carriers.bgp] table")
    bgp.add_argument("--config", dest="bgp_config", type=Path, help="the gateway's TOML (as --config)")
    bgp.add_argument("--no-ack", action="store_true", help="ExaBGP runs with exabgp.api.ack=false")
    shard = sub.add_parser("shard", help="internal: one ingest shard, started by the front (shards > 1)")
    shard.add_argument("--index", type=int, required=True)
    shard.add_argument("--shards", type=int, required=True)
    shard.add_argument("--link", required=True, help="the front's link endpoint (ipc://...)")
    shard.add_argument("--overrides", default="{}", help="the front's command-line overrides, as JSON")
    replay = sub.add_parser("replay", help="re-send captured traffic to a gateway (docs/CAPTURE.md)")
    replay.add_argument("files", type=Path, nargs="+")
    replay.add_argument("--to", required=True, metavar="ENDPOINT", help="tcp://HOST:PORT of a carrier")
    replay.add_argument("--speed", default="1x", help="1x (captured timing), 10x, ..., or max")
    replay.add_argument(
        "--ids",
        choices=["new", "original"],
        default="new",
        help="original ids exercise dedupe: a gateway that served them answers duplicates",
    )
    replay.add_argument(
        "--as-agent", type=Path, metavar="SECRET_KEYFILE", help="CURVE: the agent's .key_secret"
    )
    replay.add_argument("--server-key", type=Path, metavar="KEYFILE", help="CURVE: the gateway's public .key")
    replay.add_argument(
        "--record-decisions", type=Path, metavar="OUT.jsonl", help="write per-request decisions"
    )
    replay.add_argument("--expect", type=Path, metavar="GOLDEN.jsonl", help="fail on any decision difference")
    replay.add_argument("--timeout", type=float, default=30.0, help="wait this long for the last answers")
    replay.add_argument("--window", type=int, default=2000, help="requests in flight at most")
    replay.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.http_port is not None:
        out["http"] = {"port": args.http_port}
    if getattr(args, "shards", None) is not None and args.command != "shard":
        out["shards"] = args.shards
    logging: dict[str, str] = {}
    if args.log_format:
        logging["format"] = args.log_format
    if args.log_level:
        logging["level"] = args.log_level
    if logging:
        out["logging"] = logging
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check-config":
        return _check_config(args.path)
    if args.command == "keygen":
        return _keygen(args.out, args.agent, args.region)
    if args.command == "models":
        return _models_init(args)
    if args.command == "capture":
        from gateway.capture.inspect import inspect, render

        print(render(inspect(args.files), args.json))
        return 0
    if args.command == "replay":
        return _replay(args)
    if args.command == "bgp-announcer":
        return _bgp_announcer(args)
    overrides = json.loads(args.overrides) if args.command == "shard" else _overrides(args)
    try:
        config = load_config(args.config, overrides=overrides)
    except ConfigError as exc:
        for key, message in exc.problems:
            print(f"hk-gateway: config: {key}: {message}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "shard":
        from gateway.shards.link import ShardRole

        return run(config, args.config, overrides, shard=ShardRole(args.index, args.shards, args.link))
    return run(config, args.config, overrides)


def _bgp_announcer(args: argparse.Namespace) -> int:
    from gateway.bgp.announcer import ExaBgpPipe
    from gateway.bgp.announcer import run as announce
    from service.logs import configure_logging

    try:
        config = load_config(args.bgp_config or args.config, overrides=_overrides(args))
    except ConfigError as exc:
        for key, message in exc.problems:
            print(f"hk-gateway bgp-announcer: config: {key}: {message}", file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(config.logging)
    return announce(config, args.carrier, ExaBgpPipe(sys.stdout, sys.stdin.fileno(), ack=not args.no_ack))


def _replay(args: argparse.Namespace) -> int:
    """Exit 0, or 1 when the replay differs from ``--expect`` or lost requests, 2 on bad arguments."""
    import asyncio

    from gateway.capture import replay as rp

    speed_text = args.speed.lower()
    try:
        speed = None if speed_text == "max" else float(speed_text.removesuffix("x"))
    except ValueError:
        speed = -1.0
    if speed is not None and not speed > 0:
        print(f"hk-gateway replay: --speed must be like 1x, 10x or max, got {args.speed!r}", file=sys.stderr)
        return EXIT_CONFIG
    if (args.as_agent is None) != (args.server_key is None):
        print("hk-gateway replay: --as-agent and --server-key go together", file=sys.stderr)
        return EXIT_CONFIG
    try:
        curve, agent = _replay_identity(args.as_agent, args.server_key)
        golden = None if args.expect is None else rp.read_decisions(args.expect)
        missing = [str(p) for p in args.files if not p.is_file()]
        if missing:
            raise ValueError(f"no such file: {', '.join(missing)}")
    except (OSError, ValueError) as exc:
        print(f"hk-gateway replay: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    options = rp.ReplayOptions(
        endpoint=args.to,
        speed=speed,
        original_ids=args.ids == "original",
        curve=curve,
        agent=agent,
        window=max(1, args.window),
        timeout_s=args.timeout,
        progress=None if args.json else rp.progress_stream(),
    )
    summary, decisions = asyncio.run(rp.replay(args.files, options))
    print(summary.to_json() if args.json else rp.summary_text(summary))
    if args.record_decisions is not None:
        rp.write_decisions(decisions, args.record_decisions)
    failed = summary.lost > 0 or bool(summary.stopped_early)
    if golden is not None:
        differences = rp.compare_decisions(golden, decisions)
        for difference in differences[:50]:
            print(f"DIFF {difference}", file=sys.stderr)
        if len(differences) > 50:
            print(f"DIFF ... and {len(differences) - 50} more", file=sys.stderr)
        print(f"golden: {len(differences)} difference(s) in {len(decisions)} requests", file=sys.stderr)
        failed = failed or bool(differences)
    return 1 if failed else 0


def _replay_identity(
    secret_file: Path | None, server_file: Path | None
) -> tuple[tuple[bytes, bytes, bytes] | None, tuple[str, str] | None]:
    """CURVE keys and the (agent id, region) of ``--as-agent``; (None, None) in plaintext."""
    import zmq.auth

    from gateway.ingress.auth import read_metadata

    if secret_file is None or server_file is None:
        return None, None
    public, secret = zmq.auth.load_certificate(secret_file)
    server, _ = zmq.auth.load_certificate(server_file)
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key")
    meta = read_metadata(secret_file)
    return (public, secret, server), (
        meta.get("agent-id", secret_file.name.split(".")[0]),
        meta.get("region", ""),
    )


def _models_init(args: argparse.Namespace) -> int:
    from gateway.models.triton import write_triton_repository
    from inference.models.demo import write_demo_repository

    if args.triton is None:
        written = write_demo_repository(args.dir)
    else:
        if args.versions < 1:
            print("hk-gateway: --versions must be at least 1", file=sys.stderr)
            return EXIT_CONFIG
        written = write_triton_repository(
            args.dir, kind=args.triton, runtime=args.runtime, versions=args.versions
        )
    print(f"wrote {len(written)} files into {args.dir}")
    return 0


def _check_config(path: Path) -> int:
    try:
        config = load_config(path, environ={})
    except ConfigError as exc:
        for key, message in exc.problems:
            print(f"{path}: {key}: {message}", file=sys.stderr)
        return EXIT_CONFIG
    from gateway.dispatch.batch_limits import batch_limit_warnings

    for warning in batch_limit_warnings(config):
        print(f"{path}: warning: {warning}", file=sys.stderr)
    print(
        f"{path}: OK ({len(config.carriers)} carriers, {len(config.pools)} pools, "
        f"{len(config.backends)} backends)"
    )
    return 0


def _keygen(out: Path, agent: str | None, region: str) -> int:
    from gateway.ingress.auth import write_keypair

    if agent:
        public, secret = write_keypair(out, agent, {"agent-id": agent, "region": region})
        print(
            f"agent {agent}: give {secret} to the agent; copy {public} into the gateway's authorized_agents"
        )
    else:
        public, secret = write_keypair(out, "gateway")
        print(f"gateway: {secret} is security.server_secret_key; give {public} to every agent")
    return 0


def _ensure_demo_models(config: GatewayConfig) -> None:
    """A no-argument run serves the demo models: write them on first use."""
    for section in config.backends.values():
        repo = section.get("repository")
        if section.get("type") == "onnx" and repo == DEFAULT_MODELS_DIR and not Path(repo).exists():
            from inference.models.demo import write_demo_repository

            write_demo_repository(Path(repo))


def run(
    config: GatewayConfig,
    config_path: Path | None,
    overrides: Mapping[str, Any] | None = None,
    shard: ShardRole | None = None,
) -> int:
    """Serve until stopped; ``overrides`` (the command line's) are applied again at each SIGHUP. With more
    than one shard this process is the front (gateway/shards/front.py); ``shard``: it is one of them."""
    from gateway.shards.placement import cores, default_shards

    count = config.shards or default_shards(cores())
    if shard is None and count > 1:
        return _run_front(config, config_path, overrides, count)
    if shard is not None:
        _die_with_parent()
    if config.cpu.mode == "process":
        from gateway.dispatch.workers import start_forkserver

        start_forkserver()  # its imports run on another core while this process imports the rest
    from gateway.server import Gateway, GatewayStartError, process_age_s
    from service.logs import configure_logging, set_static_fields
    from service.runtime import run_main

    if shard is not None:
        set_static_fields(shard=shard.index)
    configure_logging(config.logging)
    _ensure_demo_models(config)
    gateway = Gateway(config, config_path=config_path, overrides=overrides, shard=shard)
    gateway.exec_to_start_s = process_age_s()
    try:
        run_main(_serve(gateway))
    except GatewayStartError as exc:
        print(f"hk-gateway: {exc}", file=sys.stderr)
        return EXIT_START
    return 0


def _run_front(
    config: GatewayConfig, config_path: Path | None, overrides: Mapping[str, Any] | None, count: int
) -> int:
    from gateway.server import process_age_s
    from gateway.shards.front import Front, FrontStartError
    from service.logs import configure_logging, set_static_fields
    from service.runtime import run_main

    set_static_fields(role="front")
    configure_logging(config.logging)
    _ensure_demo_models(config)  # before the shards start, so that they do not race to write them
    front = Front(config, count, config_path=config_path, overrides=overrides)
    front.exec_to_start_s = process_age_s()
    try:
        run_main(_serve(front))
    except FrontStartError as exc:
        print(f"hk-gateway: {exc}", file=sys.stderr)
        return EXIT_START
    return 0


def _die_with_parent() -> None:
    """A shard gets SIGTERM (and drains) when its front dies, however the front died (Linux prctl)."""
    from inference.pipeline.worker import die_with_parent

    die_with_parent(signal.SIGTERM)
    if os.getppid() == 1:  # the front died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


async def _serve(gateway: Any) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    interrupts = 0

    def on_stop(signame: str) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1 and signame == "SIGINT":
            # A second Ctrl-C means now: skip the drain.
            os._exit(130)
        stop.set()

    # add_signal_handler (not signal.signal) so that handlers run on the loop, between callbacks,
    # where setting an asyncio.Event is safe.
    loop.add_signal_handler(signal.SIGTERM, on_stop, "SIGTERM")
    loop.add_signal_handler(signal.SIGINT, on_stop, "SIGINT")
    loop.add_signal_handler(signal.SIGHUP, gateway.reload)
    await gateway.serve(stop)
