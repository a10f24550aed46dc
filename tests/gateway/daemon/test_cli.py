"""The hk-gateway command line: config validation, key generation, demo models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import ConfigError, load_config
from gateway.ingress.auth import load_directory, load_server_keys

ROOT = Path(__file__).resolve().parents[3]
TESTDATA = ROOT / "tests" / "gateway" / "testdata"
BAD = sorted(TESTDATA.glob("*.toml"))


def expected_key(path: Path) -> str:
    return path.read_text().splitlines()[0].removeprefix("# expect:").strip()


def test_annotated_example_config_is_valid() -> None:
    """deploy/hk-gateway.example.toml passes check-config."""
    assert main(["check-config", str(ROOT / "deploy" / "hk-gateway.example.toml")]) == 0


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_names_the_bad_key(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad config is refused with exit code 2 and an error naming its key."""
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f": {expected_key(path)}: " in err, err


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_reports_only_its_key(path: Path) -> None:
    """Each bad config has one mistake, and that mistake is the only problem reported (no echo elsewhere)."""
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert [key for key, _ in info.value.problems] == [expected_key(path)]


def test_bad_config_problems_carry_key_paths() -> None:
    """ConfigError lists (key path, message) for every problem at once."""
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, overrides={"http": {"port": -1}, "dedupe": {"window_s": 0}})
    assert {key for key, _ in info.value.problems} == {"http.port", "dedupe.window_s"}


def test_environment_overrides_file(tmp_path: Path) -> None:
    """HKGW_* variables override the file; nested keys use a double underscore."""
    config = load_config(environ={"HKGW_HTTP__PORT": "9300", "HKGW_INSTANCE": "hk-gw-7"})
    assert (config.http.port, config.instance) == (9300, "hk-gw-7")


def test_keygen_writes_gateway_and_agent_keys(tmp_path: Path) -> None:
    """keygen writes a usable server key pair and an agent certificate carrying its id and region."""
    assert main(["keygen", "--out", str(tmp_path / "server")]) == 0
    assert (
        main(["keygen", "--out", str(tmp_path / "agents"), "--agent", "edge-eu-1", "--region", "eu-west"])
        == 0
    )
    public, secret = load_server_keys(tmp_path / "server" / "gateway.key_secret")
    assert len(public) == len(secret) == 40
    (identity,) = load_directory(tmp_path / "agents").values()
    assert (identity.agent_id, identity.region) == ("edge-eu-1", "eu-west")


def test_models_init_is_deterministic(tmp_path: Path) -> None:
    """models init writes the same repository bytes twice."""
    assert main(["models", "init", str(tmp_path / "a")]) == 0
    assert main(["models", "init", str(tmp_path / "b")]) == 0
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files_a
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes()


def test_invalid_config_exits_non_zero_before_binding(tmp_path: Path) -> None:
    """Running with a bad config prints the key and exits 2 without starting anything."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[http]\nport = 'nine'\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "http.port" in result.stderr


def test_config_file_defaults_to_curve(tmp_path: Path) -> None:
    """A config file that does not say plaintext gets CurveZMQ, and so must name its keys."""
    config = tmp_path / "gw.toml"
    config.write_text('instance = "hk-gw-2"\n')
    with pytest.raises(ConfigError) as info:
        load_config(config, environ={})
    assert [key for key, _ in info.value.problems] == ["security"]
    assert load_config(environ={}).security.mode == "plaintext"  # the no-argument local gateway
