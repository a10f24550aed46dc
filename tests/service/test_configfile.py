"""The config loader both programs use: defaults < file < environment < flags, one validation step, every
bad key named by its dotted path."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.configfile import ConfigError, ConfigFileError, invalid, load_config


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listener(_Section):
    """A small schema standing in for a program's: nested tables, a list, a dict and a cross-check."""

    name: str
    port: int = Field(ge=1, le=65535)


class Program(_Section):
    mode: Literal["fast", "safe"] = "safe"
    listeners: tuple[Listener, ...] = Field(min_length=1)
    limits: dict[str, int] = {}
    default_listener: str = ""

    @model_validator(mode="after")
    def _default_is_a_listener(self) -> Self:
        if self.default_listener and self.default_listener not in {x.name for x in self.listeners}:
            raise invalid("Program", [(("default_listener",), "not the name of a listener")])
        return self


DEFAULTS = {"listeners": [{"name": "a", "port": 1000}], "limits": {"x": 1, "y": 2}}


def load(path: Path | None = None, environ: dict[str, str] | None = None, **overrides: object) -> Program:
    return load_config(
        Program,
        defaults=DEFAULTS,
        path=path,
        env_prefix="TEST_",
        environ=environ or {},
        overrides=overrides,
        file_replaces=("listeners",),
    )


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    """Each layer overrides the one before it, key by key inside tables."""
    config = tmp_path / "p.toml"
    config.write_text('mode = "fast"\n[limits]\nx = 10\n')
    assert load(config).limits == {"x": 10, "y": 2}
    assert load(config, {"TEST_LIMITS__X": "20"}).limits == {"x": 20, "y": 2}
    loaded = load(config, {"TEST_LIMITS__X": "20", "TEST_MODE": "safe"}, limits={"x": 30})
    assert (loaded.mode, loaded.limits) == ("safe", {"x": 30, "y": 2})


def test_a_file_table_named_to_replace_replaces_the_default(tmp_path: Path) -> None:
    """A file's own listeners replace the default list instead of being merged into it."""
    config = tmp_path / "p.toml"
    config.write_text('[[listeners]]\nname = "b"\nport = 2000\n')
    assert [x.name for x in load(config).listeners] == ["b"]


def test_every_bad_key_is_named_by_its_path() -> None:
    """Problems anywhere (a list item, a dict value, an unknown key, a wrong choice) come out together."""
    with pytest.raises(ConfigError) as caught:
        load(listeners=[{"name": "a", "port": 0}], limits={"x": "many"}, colour="red", mode="slow")
    assert sorted(key for key, _ in caught.value.problems) == [
        "colour",
        "limits.x",
        "listeners[0].port",
        "mode",
    ]
    assert dict(caught.value.problems)["colour"] == "unknown key"


def test_a_cross_check_reports_at_its_own_key() -> None:
    """A validator that checks across keys names the key it concerns, not the table it runs on."""
    with pytest.raises(ConfigError) as caught:
        load(default_listener="nope")
    assert caught.value.problems == [("default_listener", "not the name of a listener")]


def test_an_environment_value_is_named_by_its_key() -> None:
    """A bad value from the environment is reported at the config key the variable maps to."""
    with pytest.raises(ConfigError) as caught:
        load(environ={"TEST_LIMITS__Y": "lots"})
    assert caught.value.key == "limits.y"


def test_failed_list_items_are_not_echoed_as_a_short_list() -> None:
    """A list whose only item is invalid reports the item, not also 'list too short'."""
    with pytest.raises(ConfigError) as caught:
        load(listeners=[{"name": "a", "port": "x"}])
    assert [key for key, _ in caught.value.problems] == ["listeners[0].port"]


@pytest.mark.parametrize(
    ("content", "key"),
    [(None, "(file)"), ("mode = \n", "(toml)")],
    ids=["missing", "not-toml"],
)
def test_an_unreadable_file_is_a_config_error(tmp_path: Path, content: str | None, key: str) -> None:
    """A missing file or one that is not TOML is a ConfigError keyed (file) / (toml)."""
    path = tmp_path / "p.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigFileError) as caught:
        load(path)
    assert isinstance(caught.value, ConfigError)
    assert caught.value.key == key
