"""The compression report says the command that made it."""

from __future__ import annotations

import pytest

from bench.compression import command, main, parser


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--requests", "2000"], "python -m bench.compression --requests 2000 --seed 8"),
        (["--write"], "python -m bench.compression --requests 4000 --seed 8 --write"),
        (["--train-seed", "3"], "python -m bench.compression --requests 4000 --seed 8 --train-seed 3"),
    ],
)
def test_the_command_line_is_the_one_that_ran(argv: list[str], expected: str) -> None:
    """``--write`` appears only when the run wrote docs/BENCHMARKS.md (``make run`` does not)."""
    assert command(parser().parse_args(argv)) == expected


def test_the_printed_report_shows_the_command_that_ran(capsys: pytest.CaptureFixture[str]) -> None:
    """What ``make run`` prints after the demo names its own command, not a ``--write`` it did not run."""
    assert main(["--requests", "200"]) == 0
    printed = capsys.readouterr().out
    assert "Command: `python -m bench.compression --requests 200 --seed 8`" in printed
    assert "--write" not in printed
