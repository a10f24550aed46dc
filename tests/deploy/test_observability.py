"""deploy/prometheus and deploy/grafana against the real tools and the metrics the code really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from edge_agent.agent import EdgeAgent
from edge_agent.uplink import HANDLED_REJECTS
from edgewire import labels
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_config
from tests.gateway.daemon.process import SHARDS, GatewayProcess, write_config

DEPLOY = Path(__file__).parents[2] / "deploy"
METRIC = re.compile(r"\b((?:hkgw|edge)_[a-z0-9_]+)")


def promtool(*args: str) -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool missing: the test command installs the Debian package prometheus"
    done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_prometheus_config_is_valid() -> None:
    """promtool accepts the scrape config and finds its rule file."""
    out = promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert "1 rule files found" in out


def test_alert_rules_pass_their_unit_tests() -> None:
    """Every alert fires on its condition and stays quiet otherwise (promtool test rules)."""
    promtool("check", "rules", str(DEPLOY / "prometheus" / "rules" / "hk-edge.rules.yml"))
    out = promtool("test", "rules", str(DEPLOY / "prometheus" / "tests" / "hk-edge.rules.test.yml"))
    assert "SUCCESS" in out


def test_every_alert_has_a_unit_test() -> None:
    rules = (DEPLOY / "prometheus" / "rules" / "hk-edge.rules.yml").read_text()
    tests = (DEPLOY / "prometheus" / "tests" / "hk-edge.rules.test.yml").read_text()
    alerts = set(re.findall(r"- alert: (\w+)", rules))
    tested = set(re.findall(r"alertname: (\w+)", tests))
    assert alerts and alerts == tested


def test_frames_refused_alert_leaves_out_exactly_what_the_agent_resends() -> None:
    """EdgeFramesRefused pages on refusals resending cannot fix: its excluded reasons are the agent's
    HANDLED_REJECTS (split, resent, or held back and resent by the agent itself), no more, no fewer."""
    rules = (DEPLOY / "prometheus" / "rules" / "hk-edge.rules.yml").read_text()
    match = re.search(r'edge_frames_rejected_total\{reason!~"([a-z_|]+)"\}', rules)
    assert match, "EdgeFramesRefused expression not found"
    assert set(match.group(1).split("|")) == {labels.REJECT[r] for r in HANDLED_REJECTS}


def test_committed_dashboard_is_what_the_generator_writes() -> None:
    sys.path.insert(0, str(DEPLOY / "grafana"))
    try:
        import make_dashboard  # type: ignore[import-not-found]  # deploy/grafana, put on sys.path above
    finally:
        sys.path.pop(0)
    committed = json.loads((DEPLOY / "grafana" / "hk-edge-gateway.json").read_text())
    assert committed == make_dashboard.dashboard(), "run: python deploy/grafana/make_dashboard.py"


@pytest.mark.parametrize("shards", SHARDS)
async def test_dashboard_and_alerts_use_only_exported_metric_names(
    models_dir: Path, tmp_path: Path, shards: int
) -> None:
    """Every metric name in the dashboard and the alert rules is one a running gateway (the hk-gateway
    program; with shards, the front's merged /metrics) or agent exports."""
    gw = GatewayProcess(write_config(tmp_path / "gateway.toml", models_dir, shards=shards))
    try:
        await gw.start()
        endpoints = {name: gw.endpoint(name) for name in gw.ready["carriers"]}
        async with EdgeAgent(agent_config(endpoints, models_dir, tmp_path / "spool")) as agent:
            await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
            async with aiohttp.ClientSession() as session:
                texts = []
                assert agent.http is not None
                for port in (gw.http_port, agent.http.port):
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        texts.append(await response.text())
    finally:
        await gw.stop()
    exported: set[str] = set()
    for line in "\n".join(texts).splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            exported |= {name} | (
                {f"{name}_total"}
                if kind == "counter"
                else {f"{name}_{s}" for s in ("bucket", "sum", "count")}
                if kind == "histogram"
                else set()
            )
    used = set(METRIC.findall((DEPLOY / "grafana" / "hk-edge-gateway.json").read_text()))
    used |= set(METRIC.findall((DEPLOY / "prometheus" / "rules" / "hk-edge.rules.yml").read_text()))
    assert used, "no metric names found"
    assert used <= exported, sorted(used - exported)
