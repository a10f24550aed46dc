#!/usr/bin/env bash
# The GPU-tier check, on the GPU machine (with the .whl/ folder copied beside the checkout; prepare it with scripts/gpu_wheels.sh):
#   run: bash scripts/gpu_tier_device.sh        (results in $OUT: gpu_tier.json, gpu_tier.md, log)
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-tier}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt" || true
python3 -m bench.gpu_tier --out "$out" --seconds 4 "$@" 2>&1 | grep -v '"event": "carrier bound"' | tee "$out/log"
