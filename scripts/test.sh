#!/usr/bin/env bash
# The one test command (README, CI): set up, check generated code, lint, type-check, then run the suite
# inside a network namespace that has only loopback, so no test can reach beyond this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

echo "== generated code"
.venv/bin/python scripts/gen_proto.py --check
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff .; exit 1; }
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest (loopback-only network namespace)"
if [[ $(id -u) -eq 0 ]]; then
    isolate=(unshare --net)
else
    isolate=(unshare --net --map-root-user)
fi
exec "${isolate[@]}" -- sh -c 'ip link set lo up && exec .venv/bin/python -m pytest "$@"' pytest "$@"
