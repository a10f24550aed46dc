"""Real inference servers for tests and benchmarks, on loopback: Triton Inference Server and Ray Serve.

:class:`TritonServer` runs the ``tritonserver`` that ``scripts/install_tritonserver.sh`` installs (CPU,
python backend) on a model repository (``gateway.models.triton.write_triton_repository(runtime="python")``).
:func:`local_ray` starts a local Ray cluster and :class:`RayServeProxy` serves the Ray Serve application
(:mod:`inference.rayserve_app`, the one ``deploy/rayserve`` deploys) on it. Both come with the package: no
checkout is needed.

Both bind 127.0.0.1 only. Ray reaches off the machine at start (cloud metadata, DNS): start it only inside a
network namespace that has nothing but loopback, as the test command does (``unshare --net``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

# Where this process imports the project's packages from: a checkout, or site-packages.
PACKAGES_ROOT: Final = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class TritonInstall:
    """Where ``scripts/install_tritonserver.sh`` put tritonserver, its libraries and the models' Python."""

    root: Path

    @classmethod
    def find(cls) -> TritonInstall:
        """``$HKGW_TRITONSERVER`` or ``<venv>/opt/tritonserver``; a clear error when it is not installed."""
        root = Path(os.environ.get("HKGW_TRITONSERVER", Path(sys.prefix) / "opt" / "tritonserver"))
        install = cls(root)
        if not install.binary.is_file():
            raise FileNotFoundError(
                f"no tritonserver at {install.binary}; run scripts/install_tritonserver.sh"
            )
        return install

    @property
    def binary(self) -> Path:
        return self.root / "pytriton" / "tritonserver" / "bin" / "tritonserver"

    @property
    def backends(self) -> Path:
        return self.root / "pytriton" / "tritonserver" / "backends"

    def environment(self) -> dict[str, str]:
        """The server's environment: the models' Python first on PATH, the matching libpython findable."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        # The models' onnxruntime would keep a telemetry database under ~/.cache/Microsoft and a session
        # file in $TMPDIR (read at its import, in each stub).
        env.setdefault("ORT_DISABLE_TELEMETRY", "1")
        env["PATH"] = f"{self.root / 'python-env' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        libs = [str(sysconfig.get_config_var("LIBDIR")), str(self.root / "nvidia_pytriton.libs")]
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        return env


@dataclass(frozen=True)
class TritonTls:
    """tritonserver's gRPC TLS: its certificate and key, and with ``client_ca`` mutual TLS (clients must
    present a certificate that CA signed)."""

    server_cert: Path
    server_key: Path
    client_ca: Path | None = None

    def flags(self) -> list[str]:
        flags = [
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={self.server_cert}",
            f"--grpc-server-key={self.server_key}",
        ]
        if self.client_ca is not None:
            flags += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={self.client_ca}"]
        return flags


class TritonServer:
    """One tritonserver process on loopback ports that stay the same across :meth:`kill` and :meth:`start`.

    Blocking calls (a fixture of any scope can hold it; async tests call ``asyncio.to_thread(server.start)``
    when the loop must keep running). A context manager: started on enter, stopped on exit.
    """

    def __init__(
        self,
        repository: Path,
        models: tuple[str, ...],
        *,
        log_path: Path,
        install: TritonInstall | None = None,
        ready_timeout_s: float = 60.0,
        tls: TritonTls | None = None,
    ) -> None:
        """``tls``: serve gRPC over TLS (HTTP, used for readiness, stays plain)."""
        self.tls = tls
        self.repository = repository
        self.models = models
        self.log_path = log_path
        self.install = install or TritonInstall.find()
        self.ready_timeout_s = ready_timeout_s
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the KServe v2 gRPC endpoint (the ``triton`` backend's ``url``)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the process; wait for each model's ``/v2/models/<m>/ready`` (server ready is early)."""
        if self._process is not None:
            raise RuntimeError("tritonserver already running")
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(  # noqa: S603  (our own binary, fixed arguments)
                [
                    str(self.install.binary),
                    f"--model-repository={self.repository}",
                    f"--backend-directory={self.install.backends}",
                    "--grpc-address=127.0.0.1",
                    f"--grpc-port={self.grpc_port}",
                    "--http-address=127.0.0.1",
                    f"--http-port={self.http_port}",
                    # Metrics say what the scheduler holds (pending_requests): tests wait on that.
                    "--allow-metrics=true",
                    "--allow-gpu-metrics=false",
                    "--allow-cpu-metrics=false",
                    "--metrics-address=127.0.0.1",
                    f"--metrics-port={self.metrics_port}",
                    "--exit-timeout-secs=5",
                    *(self.tls.flags() if self.tls is not None else ()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.install.environment(),
                start_new_session=True,  # its own process group: the python-backend stubs die with it
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once, as a crash would."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Safe when not running."""
        self._signal_and_wait(signal.SIGTERM, timeout_s)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pending_requests(self, model: str) -> int:
        """Requests for ``model`` that Triton's scheduler holds, not yet handed to an instance (its gauge
        ``nv_inference_pending_request_count``, all versions). Tests wait on it instead of sleeping: with
        one instance busy, the next call is queued once this counts it."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        label = f'model="{model}"'
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in body.splitlines()
            if line.startswith("nv_inference_pending_request_count{") and label in line
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(self.models)
        while pending:
            if not self.running:
                raise RuntimeError(f"tritonserver exited while starting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                # A python-backend stub that fails to start can leave tritonserver hanging, not exiting.
                raise TimeoutError(
                    f"models {pending} not ready in {self.ready_timeout_s}s:\n{self.log_tail()}"
                )
            url = f"http://127.0.0.1:{self.http_port}/v2/models/{pending[0]}/ready"
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        pending.pop(0)
                        continue
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)

    def _signal_and_wait(self, sig: signal.Signals, timeout_s: float) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        with contextlib.suppress(ProcessLookupError):  # stubs left behind by a crash
            os.killpg(process.pid, signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class RayServeEndpoint:
    """A running Ray Serve application: its gRPC proxy address and application name."""

    grpc_url: str
    application: str


@contextlib.contextmanager
def local_ray(num_cpus: int = 2) -> Iterator[None]:
    """A local Ray cluster for one test session (about 1 GiB); shut down on exit.

    Workers import the project's packages from where this process did (a checkout that is not installed,
    as an install), through PYTHONPATH set before Ray starts. Its session directory is a short one under
    /tmp (Ray's unix socket paths must fit in 107 bytes).
    """
    import ray

    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PACKAGES_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")  # the replicas' onnxruntime: see TritonInstall
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(temp_dir),
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


class RayServeProxy:
    """Ray Serve on a running local cluster: its gRPC proxy (KServe v2) and HTTP proxy on free loopback
    ports, and :mod:`inference.rayserve_app` deployed under as many names as a test needs.
    """

    def __init__(self) -> None:
        self.grpc_port = free_port()
        self.http_port = free_port()

    def start(self) -> None:
        """Start Serve's controller and proxies; call inside :func:`local_ray`."""
        from ray import serve
        from ray.serve.config import HTTPOptions, gRPCOptions

        from inference import rayserve_app

        serve.start(
            http_options=HTTPOptions(host="127.0.0.1", port=self.http_port),
            grpc_options=gRPCOptions(port=self.grpc_port, grpc_servicer_functions=[rayserve_app.SERVICER]),
        )

    def deploy(
        self, repository: Path, *, application: str = "hk-models", app_args: Mapping[str, Any] | None = None
    ) -> RayServeEndpoint:
        """Deploy the application on a model repository; blocks until it is RUNNING."""
        from ray import serve

        from inference import rayserve_app

        args = {"repository": str(repository), **(app_args or {})}
        # Ray's gRPC proxy only routes to applications that have a route prefix.
        serve.run(rayserve_app.build_app(args), name=application, route_prefix=f"/{application}")
        return RayServeEndpoint(grpc_url=f"127.0.0.1:{self.grpc_port}", application=application)

    def delete(self, application: str) -> None:
        from ray import serve

        serve.delete(application)

    def shutdown(self) -> None:
        """Shut Serve down (the cluster stays)."""
        from ray import serve

        serve.shutdown()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
