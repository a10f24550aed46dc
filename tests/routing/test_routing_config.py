"""The [routing] config section: validation errors name the bad key; the demo default is valid."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from routing import Priority, RoutingConfigError, Tier, default_routing_config, load_routing_config
from routing.config import DEFAULT_ROUTING_SECTION

TESTDATA = Path(__file__).parent / "testdata"
BAD_CONFIGS = sorted(TESTDATA.glob("*.toml"))
DOCS = Path(__file__).parents[2] / "docs" / "ROUTING.md"


def routing_section(path: Path) -> tuple[dict[str, Any], str]:
    """The [routing] table of a testdata file and the key path its first line says is bad."""
    text = path.read_text()
    expected = text.splitlines()[0].removeprefix("# expect: ").strip()
    return tomllib.loads(text).get("routing", {}), expected


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=[p.stem for p in BAD_CONFIGS])
def test_bad_config_names_key(path: Path) -> None:
    """Each bad config in testdata/ is refused with an error whose first line names the bad key."""
    section, expected = routing_section(path)
    with pytest.raises(RoutingConfigError) as caught:
        load_routing_config(section)
    assert caught.value.key == expected
    assert str(caught.value).startswith(f"{expected}: ")


def test_every_problem_is_reported() -> None:
    """Several bad keys are all reported, each on its own line."""
    section = {**DEFAULT_ROUTING_SECTION, "thresholds": {"cloud": 2.0}, "deadline_slack_s": -1}
    with pytest.raises(RoutingConfigError) as caught:
        load_routing_config(section)
    assert [path for path, _ in caught.value.problems] == [
        "routing.thresholds.cloud",
        "routing.deadline_slack_s",
    ]
    assert len(str(caught.value).splitlines()) == 2


def test_section_name_prefixes_paths() -> None:
    """The section argument names the table the paths start from."""
    with pytest.raises(RoutingConfigError) as caught:
        load_routing_config({**DEFAULT_ROUTING_SECTION, "bogus": 1}, section="agent.routing")
    assert caught.value.key == "agent.routing.bogus"


def test_default_config_matches_demo() -> None:
    """The default policy has the demo's thresholds, models and pools."""
    config = default_routing_config()
    assert (config.thresholds.edge_server, config.thresholds.cloud) == (0.3, 0.7)
    assert set(config.models) == {"rank-mlp", "text-encoder", "image-classifier"}
    assert [(p.name, p.tier) for p in config.pools] == [
        ("cpu", Tier.EDGE_SERVER),
        ("gpu-a100-mig", Tier.CLOUD),
        ("gpu-a100", Tier.CLOUD),
        ("gpu-v100", Tier.CLOUD),
    ]


def test_default_pools_split_priorities() -> None:
    """Realtime goes only to the low-latency GPU pool in the cloud; batch only to throughput pools."""
    config = default_routing_config()
    takes = {p.name: set(p.priorities) for p in config.pools if p.tier is Tier.CLOUD}
    assert [n for n, ps in takes.items() if Priority.REALTIME in ps] == ["gpu-a100-mig"]
    assert [n for n, ps in takes.items() if Priority.BATCH in ps] == ["gpu-a100", "gpu-v100"]


def test_config_from_toml_string() -> None:
    """A minimal TOML section validates and fills in defaults."""
    section = tomllib.loads(
        """
        [routing.models.m]
        kind = "tensor"
        [[routing.pools]]
        name = "cpu"
        tier = "edge_server"
        models = ["m"]
        """
    )["routing"]
    config = load_routing_config(section)
    assert config.pools[0].priorities == (Priority.REALTIME, Priority.INTERACTIVE, Priority.BATCH)
    assert config.geoip_db is None


def test_docs_example_is_valid() -> None:
    """The TOML example in docs/ROUTING.md is a valid routing section."""
    blocks = re.findall(r"```toml\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert blocks, "docs/ROUTING.md has no toml example"
    config = load_routing_config(tomllib.loads(blocks[0])["routing"])
    assert config.geoip_db is not None
