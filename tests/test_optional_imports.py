"""Each import of an optional dependency, with that dependency missing, fails naming the extra to install.

Every case runs in a fresh interpreter that makes the dependency unimportable (``sys.modules[name] = None``,
which Python reads as "not installed") before importing the project module, so it tests the import lines
themselves, whatever this venv has installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import asyncio, importlib, json, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
try:
    exec(sys.argv[2])
except Exception as exc:
    extras = getattr(exc, "extras", None)
    print(json.dumps({"type": type(exc).__name__, "message": str(exc), "extras": extras}))
else:
    print(json.dumps({"type": None, "message": "", "extras": None}))
"""


def _probe(blocked: tuple[str, ...], code: str) -> dict[str, object]:
    """Run ``code`` with ``blocked`` unimportable; what it raised (type name, message, extras)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(blocked), code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize(
    ("module", "blocked", "extras"),
    [
        ("inference.backends.onnx", ("onnxruntime",), ["agent-local", "gateway"]),
        ("inference.pipeline.tokenizer", ("tokenizers",), ["agent-local", "gateway"]),
        ("inference.pipeline.image", ("PIL",), ["agent-local", "gateway"]),
        ("inference.models.demo", ("onnx",), ["gateway"]),
        ("gateway.backends.kserve.dialect", ("tritonclient",), ["gateway", "triton"]),
        ("gateway.backends.kserve.catalog", ("tritonclient",), ["gateway", "triton"]),
        ("gateway.backends.kserve.backend", ("tritonclient",), ["gateway", "triton"]),
        ("gateway.backends.kserve.tls", ("grpc",), ["gateway", "triton"]),
    ],
)
def test_importing_without_the_dependency_names_its_extra(
    module: str, blocked: tuple[str, ...], extras: list[str]
) -> None:
    """The import fails with MissingExtraError, whose message carries the pip command of the extra."""
    caught = _probe(blocked, f"importlib.import_module({module!r})")
    assert caught["type"] == "MissingExtraError", caught
    assert caught["extras"] == extras
    assert f"No module named '{blocked[0]}" in str(caught["message"])  # or a submodule of it
    assert f"pip install 'hk-edge-gateway[{extras[0]}]'" in str(caught["message"])


def test_a_torch_backend_without_pytorch_names_the_torch_extra() -> None:
    """torch is imported when a torch backend starts; without it the start error names the extra."""
    caught = _probe(
        ("torch",),
        "import gateway.backends.torch\n"
        "from inference.backends.base import create\n"
        "asyncio.run(create('torch', 'gpu', {'models': {'m': 'a:b'}}).start())",
    )
    assert caught["type"] == "RuntimeError", caught
    assert "pip install 'hk-edge-gateway[torch]'" in str(caught["message"])


def test_routing_resolves_regions_without_geoip2() -> None:
    """routing (geo included) imports without geoip2: an agent never opens a GeoIP database."""
    caught = _probe(
        ("geoip2",),
        "import routing\n"
        "assert routing.RegionResolver().resolve('', '203.0.113.9:5555') == 'unknown'\n"
        "assert routing.RegionResolver().resolve('eu-west') == 'eu-west'",
    )
    assert caught == {"type": None, "message": "", "extras": None}


def test_a_model_repository_reads_without_tritonclient() -> None:
    """The repository reader parses config.pbtxt with the vendored schema: no tritonclient, no grpcio."""
    caught = _probe(
        ("tritonclient", "grpc"),
        "from pathlib import Path\n"
        "from inference.backends.modelrepo import load_model_config, spec_from_config\n"
        "for path in sorted(Path('deploy/triton/cpu').glob('*/config.pbtxt')):\n"
        "    spec = spec_from_config(load_model_config(path), '1', path)\n"
        "    assert spec.name == path.parent.name and spec.inputs and spec.server_batching, spec\n",
    )
    assert caught == {"type": None, "message": "", "extras": None}
