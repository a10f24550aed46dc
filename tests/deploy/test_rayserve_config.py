"""deploy/rayserve/serve_config.yaml names code that exists: the application and the gRPC servicer."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "rayserve" / "serve_config.yaml"


def _resolve(dotted: str, separator: str) -> object:
    module, _, attribute = dotted.rpartition(separator)
    return getattr(importlib.import_module(module), attribute)


def test_serve_config_names_importable_code() -> None:
    """`serve deploy` would import these by name on each node; a moved module breaks it silently otherwise."""
    config = yaml.safe_load(CONFIG.read_text())
    for name in config["grpc_options"]["grpc_servicer_functions"]:
        assert callable(_resolve(name, "."))
    for app in config["applications"]:
        assert callable(_resolve(app["import_path"], ":"))
        assert "working_dir" not in app.get("runtime_env", {})  # the nodes install the package instead
