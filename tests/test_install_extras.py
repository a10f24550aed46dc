"""An edge agent host's install: ``pip install 'hk-edge-gateway[agent]'`` runs the agent without the gateway's
dependencies.

scripts/setup.sh builds that install into .venv-agent (the tests have no network); these tests run its
interpreter. The agent's modules are imported from this working tree (the interpreter's current directory
comes first on its path), so they check the code as it is now against what the agent extra installs."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGENT_VENV = ROOT / ".venv-agent"
PYTHON = AGENT_VENV / "bin" / "python"

NOT_ON_AN_AGENT = ("tritonclient", "geoip2", "grpc", "onnxruntime", "onnx", "tokenizers", "ray", "torch")
"""The gateway's and the local tier's dependencies: none of them may come with the agent extra."""

AGENT_PACKAGES = ("edge_agent", "edgewire", "routing", "service", "inference")
"""What an agent runs (docs/ARCHITECTURE.md): a test module importing anything else of the project tests more
than the agent."""


@pytest.fixture(scope="module", autouse=True)
def _agent_venv() -> None:
    if not PYTHON.is_file():
        pytest.fail(f"{AGENT_VENV.name} is missing: scripts/setup.sh builds it (pip install '.[agent]')")


def _agent_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def _project_imports(path: Path) -> set[str]:
    """Modules of the project that a test module imports (top level or not)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found.update(n for n in names if n.split(".")[0] in {*AGENT_PACKAGES, "gateway", "demo", "tests"})
    return found


def agent_unit_test_imports() -> dict[str, set[str]]:
    """tests/edge_agent modules that test the agent alone -> the project modules each imports.

    Picked by what they import: none of the gateway (or demo, or test helpers that start one) and none of
    the local tier, whose dependencies come with the agent-local extra."""
    picked: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests" / "edge_agent").glob("*.py")):
        imports = _project_imports(path)
        others = {m for m in imports if m.split(".")[0] not in AGENT_PACKAGES}
        local_tier = {m for m in imports if m == "edge_agent.local" or m.startswith("inference.backends")}
        if imports and not others and not local_tier:
            picked[path.name] = imports
    return picked


def test_edge_agent_help_runs_from_the_agent_install() -> None:
    """The installed ``edge-agent`` entry point starts and prints its usage."""
    done = subprocess.run(
        [str(AGENT_VENV / "bin" / "edge-agent"), "--help"],
        cwd=AGENT_VENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: edge-agent")


def test_the_agent_install_has_none_of_the_gateway_dependencies() -> None:
    """tritonclient, geoip2, grpcio, onnxruntime, onnx (and the rest) are not importable there."""
    done = _agent_python(
        "import importlib.util, json\n"
        f"print(json.dumps([n for n in {NOT_ON_AN_AGENT!r} if importlib.util.find_spec(n) is not None]))"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_the_agent_unit_tests_imports_load_from_the_agent_install() -> None:
    """Every project module that the agent's own unit tests import loads with only the agent extra."""
    picked = agent_unit_test_imports()
    assert {"test_discovery.py", "test_example_config.py", "test_synthetic.py"} <= set(picked), picked
    modules = sorted(set().union(*picked.values()))
    done = _agent_python(f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)")
    assert done.returncode == 0, done.stderr


def test_the_agent_daemon_loads_without_the_local_tier_dependencies() -> None:
    """``edge_agent.agent`` (what ``edge-agent`` runs) imports with the agent extra alone: the local tier's
    ONNX Runtime and tokenizers are needed only where the local tier is configured."""
    done = _agent_python("import edge_agent.agent, edge_agent.cli")
    assert done.returncode == 0, done.stderr


def test_the_example_agent_config_checks_out_on_the_agent_install() -> None:
    """``edge-agent check-config`` on deploy's example: config, routing and logs load with the agent extra."""
    done = subprocess.run(
        [str(PYTHON), "-m", "edge_agent", "check-config", "deploy/edge-agent.example.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert ": OK (agent " in done.stdout
