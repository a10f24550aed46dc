"""The agent's config: each bad config in testdata/ is refused naming its key, by check-config and at
start-up (exit code 2, nothing started); environment and flags override the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cli import main
from edge_agent.config import AgentConfigError, load_config

TESTDATA = Path(__file__).parent / "testdata"
BAD = sorted(TESTDATA.glob("*.toml"))
ROUTING_TESTDATA = Path(__file__).parents[1] / "routing" / "testdata"


def expected_key(path: Path) -> str:
    """The key a testdata file's first line says is bad."""
    return path.read_text().splitlines()[0].removeprefix("# expect:").strip()


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_check_config_names_the_bad_key(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """edge-agent check-config exits 2 and prints the file, the key and the message."""
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {expected_key(path)}: " in err, err


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_bad_config_reports_only_its_key(path: Path) -> None:
    """Each bad config has one mistake, and that is the only problem reported."""
    with pytest.raises(AgentConfigError) as caught:
        load_config(path, environ={})
    assert [key for key, _ in caught.value.problems] == [expected_key(path)]


@pytest.mark.parametrize("path", BAD, ids=[p.stem for p in BAD])
def test_start_with_a_bad_config_exits_2_naming_the_key(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """edge-agent --config BAD refuses to start: exit code 2 and the key on stderr."""
    assert main(["--config", str(path)]) == 2
    assert f"edge-agent: config: {expected_key(path)}: " in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(ROUTING_TESTDATA.glob("*.toml")), ids=lambda p: p.stem)
def test_a_bad_routing_table_is_named_as_the_routing_loader_names_it(path: Path, tmp_path: Path) -> None:
    """The agent validates routing's bad tables (tests/routing/testdata) in its one step and names the
    key as routing's own loader does."""
    config = tmp_path / "agent.toml"
    config.write_text(f'region = "us-west"\n{path.read_text()}')
    with pytest.raises(AgentConfigError) as caught:
        load_config(config, environ={})
    assert caught.value.key == expected_key(path)


def test_environment_overrides_the_file_and_flags_override_both(tmp_path: Path) -> None:
    """EDGE_* variables override the file; the command line's overrides win over both."""
    path = tmp_path / "agent.toml"
    path.write_text('region = "us-west"\n[batching]\nmax_records = 50\nlinger_ms = 5.0\n')
    environ = {"EDGE_BATCHING__MAX_RECORDS": "60"}
    assert load_config(path, environ={}).batching.max_records == 50
    from_env = load_config(path, environ=environ)
    assert (from_env.batching.max_records, from_env.batching.linger_ms) == (60, 5.0)
    flagged = load_config(path, environ=environ, overrides={"batching": {"max_records": 70}})
    assert flagged.batching.max_records == 70


def test_a_bad_environment_value_is_named_by_its_key() -> None:
    """A variable's value the key does not take is reported at the config key, not the variable."""
    with pytest.raises(AgentConfigError) as caught:
        load_config(environ={"EDGE_REGION": "us-west", "EDGE_UPLINK__MAX_INFLIGHT": "lots"})
    assert [key for key, _ in caught.value.problems] == ["uplink.max_inflight"]


def test_a_missing_file_is_a_file_error(tmp_path: Path) -> None:
    """A config path that does not exist is refused as (file), not as an empty config."""
    with pytest.raises(AgentConfigError) as caught:
        load_config(tmp_path / "missing.toml", environ={})
    assert caught.value.key == "(file)"
