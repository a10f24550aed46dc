"""Writes benchmark results into docs/BENCHMARKS.md, one marked section per benchmark."""

from __future__ import annotations

import platform
import re
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
_HEADER = (
    "# Benchmarks\n\n"
    "Every figure here is written by a script in `bench/`, with its baseline measured in the same run. Each\n"
    "section names the command that reproduces it. Benchmarks never run in the test command.\n"
)


def machine() -> str:
    """One line that says where a figure was measured."""
    return (
        f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}, numpy {np.__version__}"
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def update_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the section between this benchmark's markers, leaving the others as they are."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text.rstrip()}\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
