"""``hk-gateway bgp-announcer --config PATH --carrier NAME``: ExaBGP's API process for one carrier.

ExaBGP starts it (``process`` in deploy/bgp/exabgp.conf) and reads its stdout. Every ``interval_s`` it
reads ``/health/carriers/<name>`` from the gateway's HTTP port (``timeout_s``; no answer is DOWN), feeds
the reading to :class:`~gateway.bgp.policy.Hysteresis`, and on a change writes the ExaBGP commands for the
carrier's prefixes. With ExaBGP's API acknowledgements on (``exabgp.api.ack``, ExaBGP's default) it waits
for ``done`` (or ``error``, logged) after each command. End of stdin means ExaBGP has gone: the announcer
exits. SIGTERM/SIGINT withdraw what it announced first. Logs (JSON) go to stderr, which ExaBGP logs.

Stated timing: a drain (DRAINING) is withdrawn at the next reading, within ``interval_s``; a carrier that
goes DOWN, or a gateway that stops answering, is withdrawn after ``fall`` readings, within
``fall * interval_s + timeout_s``; a healthy carrier is announced again after ``rise`` readings.
"""

from __future__ import annotations

import os
import select
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

import structlog

from gateway.bgp.policy import Hysteresis, Reading, Route, classify, commands
from gateway.config import CarrierBgpConfig, GatewayConfig

log = structlog.get_logger("gateway.bgp")
ACK_TIMEOUT_S = 5.0
MAX_BODY = 512


def health_url(config: GatewayConfig, carrier: str) -> str:
    """The carrier's health URL on the gateway's HTTP port (a wildcard bind is asked on loopback)."""
    host = config.http.host
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # noqa: S104
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.http.port}/health/carriers/{carrier}"


def read_health(url: str, timeout_s: float) -> tuple[Reading, str]:
    """One reading and a short detail for the log; never raises."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (http URL we built)
            status, body = resp.status, resp.read(MAX_BODY).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read(MAX_BODY).decode(errors="replace")
    except (OSError, ValueError) as exc:  # refused, timeout, reset, bad status line
        return Reading.DOWN, f"no answer: {exc}"
    return classify(status, body), f"{status} {body.strip()[:80]}"


@dataclass
class ExaBgpPipe:
    """Commands out on ``output``; ExaBGP's ``done``/``error`` lines in on the raw fd ``input_fd``."""

    output: TextIO
    input_fd: int
    ack: bool
    _buffer: bytes = b""
    closed: bool = False
    errors: list[str] = field(default_factory=list)

    def send(self, command: str) -> bool:
        """Write one command (and wait for its acknowledgement); False once ExaBGP has gone."""
        try:
            self.output.write(command + "\n")
            self.output.flush()
        except (BrokenPipeError, ValueError):
            self.closed = True
            return False
        if not self.ack:
            return True
        deadline = time.monotonic() + ACK_TIMEOUT_S
        while True:
            line = self._line(deadline - time.monotonic())
            if line is None:
                if not self.closed:
                    log.warning("no acknowledgement from ExaBGP", command=command)
                return not self.closed
            if line == "error":
                self.errors.append(command)
                log.error("ExaBGP refused a command", command=command)
                return True
            if line == "done":
                return True

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds`` while watching for ExaBGP going away; False when it has."""
        deadline = time.monotonic() + max(seconds, 0.0)
        while self._line(deadline - time.monotonic()) is not None:
            pass  # anything else ExaBGP says (no "receive" is configured) is not for us
        return not self.closed

    def _line(self, timeout_s: float) -> str | None:
        """The next line from ExaBGP, or None after ``timeout_s``; marks the pipe closed at end of input
        or when ExaBGP says ``shutdown``."""
        if self.closed:
            return None
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self.input_fd], [], [], max(timeout_s, 0.0))
            if not ready:
                return None
            chunk = os.read(self.input_fd, 4096)
            if not chunk:
                self.closed = True
                return None
            self._buffer = (self._buffer + chunk)[-(1 << 16) :]  # bounded: a line is a few bytes
        raw, self._buffer = self._buffer.split(b"\n", 1)
        line = raw.decode(errors="replace").strip()
        if line == "shutdown":
            self.closed = True
            return None
        return line


def run(
    config: GatewayConfig,
    carrier: str,
    pipe: ExaBgpPipe,
    *,
    reader: Callable[[str, float], tuple[Reading, str]] = read_health,
    max_readings: int | None = None,
) -> int:
    """The announcer's loop; returns the exit status (0 when ExaBGP went away, 2 on a config problem)."""
    found = [c for c in config.carriers if c.name == carrier]
    if not found or found[0].bgp is None:
        log.error("no [carriers.bgp] for this carrier in the config", carrier=carrier)
        return 2
    bgp: CarrierBgpConfig = found[0].bgp
    url = health_url(config, carrier)
    hysteresis = Hysteresis(rise=bgp.rise, fall=bgp.fall)
    announced = False
    stopping: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)

    previous = [signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)]
    log.info("announcer started", carrier=carrier, health=url, prefixes=list(bgp.prefixes))
    readings = 0
    try:
        next_at = time.monotonic()
        while not stopping and not pipe.closed and (max_readings is None or readings < max_readings):
            reading, detail = reader(url, bgp.timeout_s)
            readings += 1
            change = hysteresis.observe(reading)
            if change is not None:
                log.info("route", carrier=carrier, route=change.name, reading=reading.value, health=detail)
                if change is not Route.WITHDRAWN or announced:
                    for command in commands(bgp, change):
                        if not pipe.send(command):
                            break
                announced = change is not Route.WITHDRAWN
            next_at += bgp.interval_s
            if not pipe.wait(next_at - time.monotonic()):
                break
    finally:
        if announced and not pipe.closed:
            log.info("withdrawing on exit", carrier=carrier)
            for command in commands(bgp, Route.WITHDRAWN):
                pipe.send(command)
        for sig, handler in zip((signal.SIGTERM, signal.SIGINT), previous, strict=True):
            signal.signal(sig, handler)
    return 0
