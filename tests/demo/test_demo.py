"""The README's main job runs end to end: gateway up, one agent process per region, traffic answered,
nothing lost, every answer that was not OK explained, clean drain of every process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from edge_agent.synthetic import PROFILES


def test_demo_answers_everything_explains_the_rest_and_drains(tmp_path: Path) -> None:
    """python -m demo (hk-gateway + one edge-agent process per region) loses nothing, explains each
    non-OK answer, shows progress, and every process exits 0 after SIGTERM.

    The share of OK answers is not asserted: on a loaded two-core CI machine realtime budgets (120-300
    ms) can run out for reasons the demo then explains; what is asserted is that none goes unexplained.
    """
    out = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, "-m", "demo", "--requests", "300", "--rate", "200", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run = json.loads(out.read_text())
    assert run["lost"] == 0
    assert run["sent"] == run["answered"] == 300
    assert [n for n in run["not_ok"] if n["explanation"] is None] == []
    assert run["ok"] + sum(n["count"] for n in run["not_ok"]) == 300

    agents = run["agents"]
    assert sorted(a["region"] for a in agents) == sorted(p.name for p in PROFILES)
    pids = {a["pid"] for a in agents} | {run["driver"]["pid"], run["gateway"]["pid"]}
    assert len(pids) == len(agents) + 2, "each agent is a process of its own"
    assert [a["exit_code"] for a in agents] == [0] * len(agents)
    assert [a["unanswered_at_stop"] for a in agents] == [0] * len(agents)
    assert run["gateway"]["exit_code"] == 0
    assert all(a["cpu_s"] > 0 for a in agents)

    assert re.search(r"sent +300/300 +answered +300", result.stdout), "progress lines"
    assert "(one per region); lost 0" in result.stdout
    assert "STATUS:UP" in result.stdout
    assert "hk-gateway drained and exited with 0" in result.stdout
