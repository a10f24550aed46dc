"""The HTTP side: health for GeoDNS and load balancers, Prometheus metrics, carrier maintenance switches.

It runs on its own thread and event loop, so that a saturated ingest loop cannot delay a health check past
a GeoDNS probe's timeout. It reads only the latest health snapshot and the metrics registry.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gateway.ops.health import CarrierState, HealthSnapshot
from gateway.ops.metrics import GatewayMetrics

# PowerDNS ifurlup needs exactly 200 and Route 53 matches on the first 5120 bytes: keep bodies short.
_TEXT = "text/plain"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_token_of(path: Path | None) -> str | None:
    """``http.admin_token_file``'s token, None without one; ValueError says what is wrong with the file."""
    try:
        return None if path is None else read_admin_token(path)
    except ValueError as exc:
        raise ValueError(f"http.admin_token_file: {exc}") from exc


def read_admin_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace dropped); a ValueError says why it is unusable."""
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if len(token) < 16:
        raise ValueError(f"{path}: the token must be at least 16 characters")
    return token


class HealthServer:
    """aiohttp on a private thread. ``snapshot`` is a callable returning the latest HealthSnapshot."""

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: Callable[[], HealthSnapshot],
        metrics: GatewayMetrics,
        set_carrier_enabled: Callable[[str, bool], bool],
        stale_after_s: float,
        set_capture: Callable[[float], float] | None = None,
        admin_token: str | None = None,
        render_metrics: Callable[[], Awaitable[bytes]] | None = None,
    ) -> None:
        """``admin_token``: when set, the /admin routes need ``Authorization: Bearer <token>``."""
        self._host = host
        self._port = port
        self._snapshot = snapshot
        self._metrics = metrics
        self._set_enabled = set_carrier_enabled
        self._stale_after_s = stale_after_s
        self._set_capture = set_capture
        self._render_metrics = render_metrics  # with shards: the front's merge of every shard's series
        self._admin_token = None if admin_token is None else admin_token.encode()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.port = port

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._main, name="hkgw-http", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            raise RuntimeError("HTTP server did not start")
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001  (handed to start(), which re-raises it)
            self._error = exc
            self._started.set()
            return
        self._started.set()
        loop.run_forever()
        loop.run_until_complete(self._shutdown())
        loop.close()

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._admin_guard])
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/health/carriers/{name}", self._carrier)
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_post("/admin/carriers/{name}/{action}", self._admin_carrier)
        app.router.add_post("/admin/capture", self._admin_capture)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        # aiohttp exposes the bound port only through the underlying server's sockets.
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._thread = None

    # ------------------------------------------------------------------ handlers

    def _fresh(self) -> HealthSnapshot | None:
        snap = self._snapshot()
        if time.monotonic() - snap.evaluated_at > self._stale_after_s:
            return None
        return snap

    async def _healthz(self, request: web.Request) -> web.Response:
        if self._fresh() is None:
            return web.Response(status=503, text="STATUS:DOWN event loop stalled\n", content_type=_TEXT)
        return web.Response(text="OK\n", content_type=_TEXT)

    async def _readyz(self, request: web.Request) -> web.Response:
        """200 ``READY``, or 503 ``NOT READY`` with why: ``draining`` first when it is, then each tier that
        has pools and its health (``NOT READY draining edge_server=ok cloud=ok``)."""
        snap = self._fresh()
        if snap is None:
            return web.Response(status=503, text="NOT READY event loop stalled\n", content_type=_TEXT)
        if not snap.ready:
            words = ["draining"] if snap.draining else []
            words += [f"{t}={'ok' if ok else 'down'}" for t, ok in snap.tiers.items()]
            return web.Response(status=503, text=" ".join(["NOT READY", *words]) + "\n", content_type=_TEXT)
        return web.Response(text="READY\n", content_type=_TEXT)

    async def _carrier(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        snap = self._fresh()
        if snap is None:
            return web.Response(status=503, text="STATUS:DOWN event loop stalled\n", content_type=_TEXT)
        state = snap.carriers.get(name)
        if state is None:
            return web.Response(status=404, text=f"STATUS:UNKNOWN no carrier {name}\n", content_type=_TEXT)
        detail = snap.details.get(name, "")
        return web.Response(
            status=state.http_status, text=f"STATUS:{state.value} {detail}\n", content_type=_TEXT
        )

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        body = self._metrics.render() if self._render_metrics is None else await self._render_metrics()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @web.middleware
    async def _admin_guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """/admin routes need the bearer token when one is configured; 401 (counted) otherwise."""
        resource = request.match_info.route.resource  # the route matched, however the path was spelt
        if (
            self._admin_token is not None
            and resource is not None
            and resource.canonical.startswith("/admin/")
        ):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            token = given.strip().encode("utf-8", "surrogateescape")  # aiohttp keeps raw bytes as surrogates
            if scheme.lower() != "bearer" or not hmac.compare_digest(token, self._admin_token):
                reason = "missing" if not token else "wrong"
                self._metrics.child(self._metrics.admin_refused, reason).inc()
                return web.Response(
                    status=401,
                    text="admin routes need Authorization: Bearer <token>\n",
                    content_type=_TEXT,
                    headers={"WWW-Authenticate": 'Bearer realm="hk-gateway admin"'},
                )
        return await handler(request)

    async def _admin_carrier(self, request: web.Request) -> web.Response:
        name, action = request.match_info["name"], request.match_info["action"]
        if action not in ("enable", "disable"):
            return web.Response(status=400, text="action must be enable or disable\n", content_type=_TEXT)
        if not self._set_enabled(name, action == "enable"):
            return web.Response(status=404, text=f"no carrier {name}\n", content_type=_TEXT)
        return web.Response(text=f"carrier {name} {action}d\n", content_type=_TEXT)

    async def _admin_capture(self, request: web.Request) -> web.Response:
        """``POST /admin/capture?seconds=N``: capture for N seconds (capped by config); 0 stops it."""
        if self._set_capture is None:
            return web.Response(status=404, text="capture is not available\n", content_type=_TEXT)
        try:
            seconds = float(request.query.get("seconds", "60"))
        except ValueError:
            return web.Response(status=400, text="seconds must be a number\n", content_type=_TEXT)
        if not seconds >= 0:  # also refuses NaN
            return web.Response(status=400, text="seconds must be >= 0\n", content_type=_TEXT)
        until = self._set_capture(seconds)
        if not until:
            return web.Response(text="capture off\n", content_type=_TEXT)
        return web.Response(text=f"capture on until {until:.0f} (unix)\n", content_type=_TEXT)


__all__ = ["CarrierState", "HealthServer"]
