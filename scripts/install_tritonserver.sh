#!/usr/bin/env bash
# Installs a real Triton Inference Server for the tests into .venv/opt/tritonserver (idempotent):
#  - tritonserver 2.51 (python backend only) and its bundled libraries, taken from the nvidia-pytriton
#    wheel (pip download; the wheel itself is not installed: it pins numpy < 2);
#  - the python-backend stub beside the backend, as Triton looks for it;
#  - python-env/: the Python environment the stub runs models in (numpy < 2, which the stub was built
#    against, and onnxruntime), made from the same Python as .venv so the stub's libpython matches.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTRITON_VERSION=0.7.0
dest=.venv/opt/tritonserver
stamp=$dest/.installed-$PYTRITON_VERSION
[[ -f $stamp ]] && exit 0

echo "setup: installing tritonserver (nvidia-pytriton $PYTRITON_VERSION) into $dest"
rm -rf "$dest"
mkdir -p "$dest"
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
.venv/bin/python -m pip download -q --no-deps -d "$wheel_dir" "nvidia-pytriton==$PYTRITON_VERSION" 2>&1 \
    | grep -v '^WARNING: Location' || true
.venv/bin/python - "$wheel_dir" "$dest" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("nvidia_pytriton-*.whl"))
dest = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        if info.filename.startswith(("pytriton/tritonserver/", "nvidia_pytriton.libs/")):
            target = zf.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            pathlib.Path(target).chmod(mode or 0o644)
PY
server=$dest/pytriton/tritonserver
chmod +x "$server/bin/tritonserver" "$server"/python_backend_stubs/*/triton_python_backend_stub
pyver=$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
cp "$server/python_backend_stubs/$pyver/triton_python_backend_stub" "$server/backends/python/"

base_python=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$base_python" -m venv "$dest/python-env"
ort_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("onnxruntime"))')
"$dest/python-env/bin/python" -m pip install -q "numpy<2" "onnxruntime==$ort_version" 2>&1 \
    | grep -v '^WARNING: Location' || true
"$dest/python-env/bin/python" -c 'import numpy, onnxruntime'
libdir=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')
if ! ls "$libdir"/libpython"$pyver".so* >/dev/null 2>&1; then
    echo "setup: $base_python has no shared libpython in $libdir; Triton's python backend needs one" >&2
    exit 1
fi
touch "$stamp"
