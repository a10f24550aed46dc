#!/usr/bin/env bash
# Fetches, here, the wheels the GPU machine lacks for bench/gpu_tier.py (it has torch, transformers, timm,
# numpy, grpcio, aiohttp, onnx, onnxruntime, uvloop, prometheus-client; Python 3.12; nothing downloads there)
# into .whl/ (git-ignored), to copy to the GPU machine with the checkout. About 12 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]/#/--platform=}" -d .whl \
    pyzmq zstandard structlog pydantic pydantic-core annotated-types typing-inspection "tritonclient==2.73.0" \
    python-rapidjson uuid-utils geoip2 maxminddb "protobuf==6.33.6"
du -sh .whl
