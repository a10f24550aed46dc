"""The README's main job runs end to end: gateway up, traffic answered, nothing lost, clean drain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_answers_everything_and_drains(tmp_path: Path) -> None:
    """python -m demo (gateway + one edge agent per region) loses nothing and drains cleanly."""
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--requests", "300", "--rate", "200"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(one per region); lost 0" in result.stdout
    assert "STATUS:UP" in result.stdout
    assert "drained and exited with 0" in result.stdout
