#!/usr/bin/env bash
# The main job: set up, then generate realistic synthetic traffic and report what compression does to it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/edge-agent traffic --requests 4000
echo
exec .venv/bin/python -m bench.compression
