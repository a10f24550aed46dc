"""deploy/systemd units against the real systemd-analyze: verify clean, hardening score, drain timing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

DEPLOY = Path(__file__).parents[2] / "deploy"
UNITS = ["hk-gateway.service", "edge-agent@.service", "exabgp.service"]
MAX_EXPOSURE = 2.0  # systemd-analyze security: 0 (locked down) .. 10 (unprotected); "OK" is below 4.5


def analyze(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze missing: the test command installs the Debian package systemd"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False, cwd=cwd)


def installed_copy(unit: str, into: Path) -> Path:
    """The unit as installed, except that ExecStart points at this checkout's venv (verify checks that the
    binary exists; /opt/hk-edge-gateway is where docs/OPERATIONS.md installs it)."""
    text = (DEPLOY / "systemd" / unit).read_text()
    assert "/opt/hk-edge-gateway/.venv/bin/" in text
    target = into / unit
    target.write_text(text.replace("/opt/hk-edge-gateway/.venv", sys.prefix))
    return target


@pytest.mark.parametrize("unit", UNITS)
def test_unit_verifies_without_any_warning(unit: str, tmp_path: Path) -> None:
    """systemd-analyze verify prints nothing and exits 0 (a template is verified as an instance)."""
    installed_copy(unit, tmp_path)
    name = unit.replace("@.", "@us-west.")
    done = analyze("verify", "--man=no", name, cwd=tmp_path)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


@pytest.mark.parametrize("unit", UNITS)
def test_hardening_exposure_is_at_most_the_stated_threshold(unit: str, tmp_path: Path) -> None:
    """systemd-analyze security --offline=true scores each unit at most MAX_EXPOSURE."""
    path = installed_copy(unit, tmp_path)
    done = analyze("security", "--offline=true", str(path), cwd=tmp_path)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE


def test_gateway_unit_gives_the_drain_time_to_finish() -> None:
    """TimeoutStopSec exceeds the example config's drain grace + timeout; notify with a watchdog."""
    unit = (DEPLOY / "systemd" / "hk-gateway.service").read_text()
    config = tomllib.loads((DEPLOY / "hk-gateway.example.toml").read_text())
    timeout = re.search(r"^TimeoutStopSec=(\d+)s$", unit, re.M)
    assert timeout, "hk-gateway.service sets no TimeoutStopSec"
    stop = float(timeout.group(1))
    assert stop > config["drain_timeout_s"] + config["drain_grace_s"] + 5
    assert re.search(r"^Type=notify$", unit, re.M) and re.search(r"^WatchdogSec=\d+s$", unit, re.M)
    assert re.search(r"^CPUQuota=1600%$", unit, re.M)  # at most 16 logical cores


@pytest.mark.parametrize(
    ("config", "unit", "instance", "secrets"),
    [
        (
            "hk-gateway.example.toml",
            "hk-gateway.service",
            "hk-gateway.service",
            [
                ("security", "server_secret_key"),
                ("http", "admin_token_file"),
                ("capture", "redact_key_file"),
                ("backends.triton-a100", "tls_key_file"),
            ],
        ),
        (
            "edge-agent.example.toml",
            "edge-agent@.service",
            "edge-agent@us-west.service",
            [("security", "agent_secret_key")],
        ),
    ],
)
def test_secret_files_reach_the_dynamic_user_as_credentials(
    config: str, unit: str, instance: str, secrets: list[tuple[str, str]]
) -> None:
    """The units run as a DynamicUser, which cannot read root-only (0600) key files: every secret the
    example config names is a credential of its unit (LoadCredential; /run/credentials/<unit>/<id>)."""
    settings = tomllib.loads((DEPLOY / config).read_text())
    loaded = dict(
        re.findall(r"^LoadCredential=([^:\n]+):(\S+)$", (DEPLOY / "systemd" / unit).read_text(), re.M)
    )
    for section, key in secrets:
        table = settings
        for part in section.split("."):
            table = table[part]
        path = Path(table[key])
        assert path.parent == Path("/run/credentials") / instance, (section, key, path)
        assert path.name in loaded, (section, key, sorted(loaded))
        assert loaded[path.name].startswith(("/etc/hk-gateway/", "/etc/edge-agent/"))
