"""Benchmarks that start servers run inside a network namespace that has only loopback, like the tests.

Run as root outside one, such a benchmark executes itself again under ``unshare --net`` (loopback up), so
nothing it starts can reach beyond this machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

INSIDE: Final = "HKEG_BENCH_IN_NAMESPACE"
"""Set in the re-executed process: it runs the benchmark itself."""
REPO: Final = Path(__file__).resolve().parents[1]


def isolated() -> bool:
    """True inside a network namespace with only loopback."""
    return {name for _, name in socket.if_nameindex()} <= {"lo"}


def reexec_in_namespace(module: str, argv: Sequence[str]) -> int | None:
    """As root outside an isolated namespace: run ``python -m module argv`` again inside ``unshare --net``
    (loopback up) and return its exit code; None when this process should do the runs itself."""
    if os.environ.get(INSIDE) or os.geteuid() != 0 or isolated():
        return None
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    inner = " ".join(["exec", sys.executable, "-m", module, *(f"'{a}'" for a in argv)])
    return subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", f"ip link set lo up && {inner}"],
        env={**os.environ, INSIDE: "1"},
        cwd=REPO,
        check=False,
    ).returncode
