"""The vendored Triton ModelConfig (proto/triton, edgewire.pb.triton) is tritonclient's, file for file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as tritonclient_schema

from edgewire.pb.triton import model_config_pb2

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    str(p.relative_to(ROOT))
    for p in [*(ROOT / "deploy" / "triton").rglob("*.pbtxt"), *(ROOT / "tests").rglob("*.pbtxt")]
)

# Parses each config.pbtxt with one schema module, in an interpreter that cannot import the other.
_PARSE = """
import importlib, json, sys
from pathlib import Path
from google.protobuf import text_format
sys.modules[sys.argv[2]] = None
schema = importlib.import_module(sys.argv[1])
out = {}
for path in sys.argv[3:]:
    config = schema.ModelConfig()
    try:
        text_format.Parse(Path(path).read_text(encoding="utf-8"), config)
    except text_format.ParseError as exc:
        out[path] = "error: " + str(exc)
    else:
        out[path] = config.SerializeToString(deterministic=True).hex()
print(json.dumps(out))
"""


def _parsed_with(schema: str, blocked: str) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _PARSE, schema, blocked, *CONFIGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parsed: dict[str, str] = json.loads(done.stdout)
    return parsed


def test_the_vendored_schema_is_the_file_tritonclient_registers() -> None:
    """Same descriptor, so a process importing both holds one ModelConfig (else protobuf refuses the second).

    When this fails after a tritonclient upgrade: copy that release's model_config.proto from
    triton-inference-server/common into proto/triton, run `make proto`, and widen the pin in pyproject.toml.
    """
    assert model_config_pb2.DESCRIPTOR.name == tritonclient_schema.DESCRIPTOR.name == "model_config.proto"
    assert model_config_pb2.DESCRIPTOR.serialized_pb == tritonclient_schema.DESCRIPTOR.serialized_pb
    assert model_config_pb2.ModelConfig is tritonclient_schema.ModelConfig


def test_every_config_file_parses_as_it_did_with_tritonclient() -> None:
    """deploy/triton and the tests' config.pbtxt files: the same messages, and the same parse errors."""
    assert len(CONFIGS) > 10
    vendored = _parsed_with("edgewire.pb.triton.model_config_pb2", blocked="tritonclient")
    upstream = _parsed_with("tritonclient.grpc.model_config_pb2", blocked="edgewire")
    assert vendored == upstream
    assert any(v.startswith("error: ") for v in vendored.values())  # the refused ones are compared too
    assert sum(not v.startswith("error: ") for v in vendored.values()) >= 6  # deploy/triton's six parse
