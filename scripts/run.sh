#!/usr/bin/env bash
# The main job: set up, then run a real hk-gateway (loopback carriers, embedded ONNX demo models) and one
# edge-agent process per region under realistic synthetic cross-border traffic and print what happened
# (demo/run.py); then the compression report.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m demo "$@"
echo
.venv/bin/python -m bench.compression --requests 2000
