"""Backend options: one model per backend type, in a registry, checked as part of the gateway's config with
each bad option named by its dotted path."""

from __future__ import annotations

from typing import Any

import pytest

import gateway.backends.builtin  # noqa: F401  (registers the shipped backend types)
from gateway.config import ConfigError, load_config
from inference.backends.base import create, registered_types
from inference.backends.onnx import OnnxBackend
from inference.backends.options import BackendOptionsError, option_types, options_model


def gateway_with(backends: dict[str, dict[str, Any]], environ: dict[str, str] | None = None) -> None:
    """Load the local gateway with these backends besides its embedded one."""
    embedded = {"type": "onnx", "repository": "var/models"}
    load_config(environ=environ or {}, overrides={"backends": {"embedded": embedded, **backends}})


def test_every_shipped_backend_type_has_an_options_model() -> None:
    """Every type gateway.backends.builtin registers has an options model for check-config to read."""
    assert set(registered_types()) - set(option_types()) <= {"fault-injecting"}  # gateway.testing's
    assert option_types() == ["null", "onnx", "rayserve", "torch", "triton"]


@pytest.mark.parametrize(
    ("kind", "section", "key"),
    [
        ("onnx", {"repository": "/m", "threads": 0}, "threads"),
        ("onnx", {"repository": "/m", "threads": True}, "threads"),
        ("onnx", {"repository": "/m", "device": "tpu"}, "device"),
        ("null", {"max_models": "all"}, "max_models"),
        ("null", {"simulated_row_s": -0.001}, "simulated_row_s"),
        ("triton", {"url": "10.0.0.1:8001", "call_timeout_s": 0}, "call_timeout_s"),
        ("triton", {"url": "10.0.0.1:8001", "pins": {"rank-mlp": "latest"}}, "pins.rank-mlp"),
        ("triton", {"url": "10.0.0.1:8001", "models": ["a", ""]}, "models[1]"),
        ("triton", {"url": "10.0.0.1:8001", "tls": True, "tls_cert_file": "/c.pem"}, "tls_key_file"),
        ("rayserve", {"url": "10.0.0.1:9000", "channels": 65}, "channels"),
        ("torch", {"models": {"m": "a:b"}, "threads": 17}, "threads"),
    ],
)
def test_check_config_and_the_factory_name_the_same_option(
    kind: str, section: dict[str, Any], key: str
) -> None:
    """The gateway config reports backends.<name>.<option>; building the backend alone names the option."""
    with pytest.raises(ConfigError) as caught:
        gateway_with({"remote": {"type": kind, **section}})
    assert [k for k, _ in caught.value.problems] == [f"backends.remote.{key}"]
    with pytest.raises(BackendOptionsError) as built:
        create(kind, "remote", section)
    assert built.value.keys() == [f"backends.remote.{key}"]
    assert str(built.value).startswith(f"backend 'remote': option {key!r} ")


def test_every_bad_option_of_every_backend_is_reported_at_once() -> None:
    """Problems in several backends and several options come out in one error."""
    with pytest.raises(ConfigError) as caught:
        gateway_with(
            {
                "gpu0": {"type": "triton", "url": "10.0.0.1", "channels": 0},
                "ray": {"type": "rayserve", "url": "10.0.0.2:9000", "aplication": "x"},
            }
        )
    assert sorted(k for k, _ in caught.value.problems) == [
        "backends.gpu0.channels",
        "backends.gpu0.url",
        "backends.ray.aplication",
    ]
    assert "known: application, " in dict(caught.value.problems)["backends.ray.aplication"]


def test_an_option_from_the_environment_is_parsed_like_its_toml_value() -> None:
    """HKGW_BACKENDS__<NAME>__<OPTION> is a string; the backend gets the number it spells."""
    config = load_config(environ={"HKGW_BACKENDS__EMBEDDED__THREADS": "3"})
    section = config.backends["embedded"]
    backend = create(section["type"], "embedded", {k: v for k, v in section.items() if k != "type"})
    assert isinstance(backend, OnnxBackend)
    assert backend.options.threads == 3


def test_a_bad_option_from_the_environment_is_named_by_its_key() -> None:
    """An environment value the option does not take is reported at the option's config key."""
    with pytest.raises(ConfigError) as caught:
        load_config(environ={"HKGW_BACKENDS__EMBEDDED__RESCAN_INTERVAL_S": "soon"})
    assert [k for k, _ in caught.value.problems] == ["backends.embedded.rescan_interval_s"]


def test_an_unknown_type_names_the_known_ones() -> None:
    """A type nothing registered is refused at its key, listing the registered types."""
    with pytest.raises(LookupError, match=r"known: (\w+, )*onnx(,|$)"):
        options_model("tensorflow")
    with pytest.raises(ConfigError) as caught:
        gateway_with({"tf": {"type": "tensorflow"}})
    ((key, message),) = caught.value.problems
    assert key == "backends.tf.type"
    assert "triton" in message.partition("known: ")[2].split(", ")


def test_a_type_registered_without_options_is_checked_by_building_it() -> None:
    """gateway.testing's wrapper has a factory and no options model: its section is checked by the factory."""
    import gateway.testing  # noqa: F401  (registers fault-injecting)

    with pytest.raises(ConfigError) as caught:
        gateway_with({"wrapped": {"type": "fault-injecting", "inner": {"type": "onnx", "threads": 0}}})
    ((key, message),) = caught.value.problems
    assert key == "backends.wrapped"
    assert "'threads' must be a positive integer" in message


def test_a_refused_value_is_shown_as_toml_not_as_a_python_repr() -> None:
    """`channels = true` is refused saying `got true` (what the operator wrote), not Python's `True`."""
    with pytest.raises(ConfigError) as caught:
        gateway_with({"gpu0": {"type": "triton", "url": "10.0.0.1:8001", "channels": True}})
    message = dict(caught.value.problems)["backends.gpu0.channels"]
    assert message.endswith("got true"), message
