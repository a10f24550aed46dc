"""Make a replay regression case: a capture and its golden decisions, under tests/replay/cases/NAME/.

    python -m tests.replay.make_case NAME [--requests 1200] [--seed 7]              # synthetic traffic
    python -m tests.replay.make_case NAME --from-capture FILE... [--speed 4x]       # an operator's capture

From synthetic traffic it captures with a real gateway (every kind and region); from existing capture
files (e.g. production, captured with ``[capture] redact = true``) it copies them. Either way it then
replays the capture against a fresh gateway with the replay routing policy (tests/replay/support.py) and
writes the decisions as ``golden.jsonl``. Review the golden file, then commit the directory; the replay
suite (tests/replay/test_cases.py) replays every case and fails on any difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from gateway.capture.format import SUFFIX
from gateway.capture.replay import ReplayOptions, replay, summary_text, write_decisions
from gateway.testing import run_gateway
from inference.models.demo import write_demo_repository
from tests.replay.support import capture_synthetic, gateway_overrides

CASES = Path(__file__).with_name("cases")


async def make(name: str, requests: int, seed: int, sources: list[Path], speed: float) -> None:
    case = CASES / name
    case.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        models = Path(scratch) / "models"
        write_demo_repository(models)
        if sources:
            for i, source in enumerate(sorted(sources)):
                shutil.copyfile(source, case / f"capture-{i:03d}{SUFFIX}")
        else:
            captured = Path(scratch) / "capture"
            await capture_synthetic(models, captured, requests, seed)
            for i, source in enumerate(sorted(captured.glob(f"*{SUFFIX}"))):
                shutil.copyfile(source, case / f"capture-{i:03d}{SUFFIX}")
        files = sorted(case.glob(f"*{SUFFIX}"))
        async with run_gateway(models_dir=models, **gateway_overrides()) as gw:
            summary, decisions = await replay(files, ReplayOptions(endpoint=gw.endpoint("hgc"), speed=speed))
    write_decisions(decisions, case / "golden.jsonl")
    (case / "case.json").write_text(json.dumps({"speed": speed, "requests": summary.requests_sent}) + "\n")
    print(summary_text(summary))
    print(f"wrote {case}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--from-capture", type=Path, nargs="*", default=[])
    parser.add_argument("--speed", default="4x")
    args = parser.parse_args()
    asyncio.run(make(args.name, args.requests, args.seed, args.from_capture, float(args.speed.rstrip("x"))))


if __name__ == "__main__":
    main()
