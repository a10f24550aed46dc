"""The replay suite: each committed case replays against a fresh gateway with exactly its golden decisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.capture.format import SUFFIX
from gateway.capture.inspect import inspect
from gateway.capture.replay import ReplayOptions, compare_decisions, read_decisions, replay
from gateway.testing import run_gateway
from tests.replay.support import gateway_overrides

CASES = sorted(p for p in (Path(__file__).parent / "cases").iterdir() if p.is_dir())


def load(case: Path) -> tuple[list[Path], dict[str, Any], dict[str, dict[str, str]]]:
    """A case's capture files, its case.json and its golden decisions."""
    files = sorted(case.glob(f"*{SUFFIX}"))
    return files, json.loads((case / "case.json").read_text()), read_decisions(case / "golden.jsonl")


def test_there_are_cases() -> None:
    """The suite is not empty (a missing cases directory would pass vacuously)."""
    assert CASES


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_case_replays_with_its_golden_decisions(case: Path, models_dir: Path) -> None:
    """Replay the case's capture; every request's outcome, status, tier, pool and reason match golden."""
    files, meta, golden = load(case)
    stats = inspect(files).as_dict()
    assert stats["requests"] == meta["requests"] == len(golden)
    assert not stats["corrupt"]
    async with run_gateway(models_dir=models_dir, **gateway_overrides()) as gw:
        summary, decisions = await replay(
            files, ReplayOptions(endpoint=gw.endpoint("hgc"), speed=meta["speed"])
        )
    differences = compare_decisions(golden, decisions)
    assert not differences, "\n".join(str(d) for d in differences[:20])
    assert summary.lost == 0
