#!/usr/bin/env bash
# Idempotent setup for a fresh machine: a virtualenv with the project and its dev tools, plus the Debian
# packages that the tests drive as real servers and tools. Re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# Debian packages the test suite uses (real tools, not fakes): promtool comes with prometheus,
# systemd-analyze with systemd, pdns_server and pdnsutil (GeoDNS) with pdns-server and its backends,
# bird and birdc (a BGP peer for the route health tests) with bird2, nft (black-holed carriers in the
# recovery tests, inside the tests' own network namespace) with nftables.
APT_PACKAGES=(${HKEG_APT_PACKAGES:-iproute2 util-linux prometheus systemd pdns-server pdns-backend-bind pdns-backend-geoip bird2 nftables})

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: need Python >= 3.11 as \$PYTHON (found $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi

# Debian's own Python needs two more packages: venv's ensurepip (python3-venv) and the shared libpython
# that Triton's python backend loads (scripts/install_tritonserver.sh). A Python built elsewhere has both.
if [[ $(readlink -f "$(command -v "$PYTHON")") == /usr/bin/* ]]; then
    pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    APT_PACKAGES+=("python$pyver-venv" "libpython$pyver")
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "setup: installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
        # The tests start their own pdns_server and bird; packaged ones listening on this host are not wanted.
        if [[ -d /run/systemd/system ]]; then
            systemctl disable --now pdns.service bird.service >/dev/null 2>&1 || true
        fi
    else
        echo "setup: missing Debian packages ${missing[*]}; install them as root" >&2
        exit 1
    fi
fi

stamp=.venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)
if [[ ! -f $stamp ]]; then
    [[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    echo "setup: installing the project and its dev tools into .venv"
    .venv/bin/python -m pip install -q -e '.[dev]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import edgewire, zmq, zstandard, onnxruntime' # fail here, not in the tests
    rm -f .venv/.installed-*
    touch "$stamp"
fi

# PyTorch for the torch backend's tests, which run its calls on the CPU. Pinned: where the machine's pip
# offers this release's CPU wheel (about 20 s to install) it takes that; elsewhere PyPI's default build (several
# GB with CUDA) unless PIP_EXTRA_INDEX_URL names PyTorch's CPU index. An open range would always take the latter.
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
    echo "setup: installing PyTorch (CPU) into .venv"
    .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import torch' # fail here, not in the tests
fi

# An edge agent host's install, for tests/test_install_extras.py: pip install '.[agent]' (not editable)
# into .venv-agent, from a clean copy of the packages (a build in the tree would ship files since removed).
# Built here because the tests run without a network. A new pyproject.toml rebuilds the venv from scratch,
# so it never keeps a dependency the agent extra no longer has; changed sources reinstall the project.
packages=$(.venv/bin/python -c 'import tomllib; print(*(p.rstrip("*") for p in tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"]["find"]["include"]))')
deps=$(sha256sum pyproject.toml | cut -c1-16)
code=$(find $packages -type f -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
if [[ ! -f .venv-agent/.installed-$deps-$code ]]; then
    if ! compgen -G ".venv-agent/.installed-$deps-*" >/dev/null; then
        rm -rf .venv-agent
        "$PYTHON" -m venv .venv-agent
    fi
    echo "setup: installing the project with only its agent extra into .venv-agent"
    src=$(mktemp -d)
    tar -cf - --exclude=__pycache__ pyproject.toml README.md $packages | tar -xf - -C "$src"
    rm -f .venv-agent/.installed-*
    .venv-agent/bin/python -m pip install -q "$src[agent]" 2>&1 | grep -v '^WARNING: Location' || true
    rm -rf "$src"
    .venv-agent/bin/edge-agent --help >/dev/null # fail here, not in the tests
    touch ".venv-agent/.installed-$deps-$code"
fi

# A real Triton Inference Server for the backend tests (CPU, python backend): scripts/install_tritonserver.sh.
scripts/install_tritonserver.sh
