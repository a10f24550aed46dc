"""The README's main job runs end to end: gateway up, traffic answered, nothing lost, clean drain."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_answers_everything_and_drains(tmp_path: Path) -> None:
    """python -m gateway.demo reports no lost request and a drained exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway.demo", "--requests", "300", "--rate", "600"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "lost 0, answered twice 0" in result.stdout
    assert "STATUS:UP" in result.stdout
    assert "drained and exited with 0" in result.stdout
