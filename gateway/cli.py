"""``hk-gateway``: the Hong Kong ingest daemon's command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="hk-gateway",
        description="Hong Kong ingest gateway of hk-edge-gateway: terminates agent traffic on every carrier, "
        "routes it across tiers and backend pools, and answers the agents.",
    )


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    build_parser().print_help()
    return 0
