"""systemd's notify protocol (sd_notify): READY=1, WATCHDOG=1, STOPPING=1 over $NOTIFY_SOCKET."""

from __future__ import annotations

import asyncio
import os
import socket


class SystemdNotifier:
    """Sends state lines to the socket systemd gave us; a no-op when not run by systemd."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        watchdog_for_us = not pid or pid == str(os.getpid())
        self.watchdog_s = int(usec) / 1e6 if usec.isdigit() and watchdog_for_us else 0.0
        self.sent: list[str] = []  # the first few states sent, for diagnostics
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, state: str) -> None:
        if not self._address:
            return
        # Never block the event loop on the notify socket: a reader that stopped reading must not stop us.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            try:
                sock.connect(self._address)
                sock.send(state.encode())
            except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                self.dropped += 1
                return
        if len(self.sent) < 64:
            self.sent.append(state)


async def watchdog(notifier: SystemdNotifier) -> None:
    """WATCHDOG=1 every half interval, sent from the event loop itself: a wedged loop stops the pings and
    systemd restarts the service."""
    while True:
        notifier.notify("WATCHDOG=1")
        await asyncio.sleep(notifier.watchdog_s / 2)
