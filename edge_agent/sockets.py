"""Sends on ZeroMQ sockets that never wait: the agent's one loop must not stall on a slow peer."""

from __future__ import annotations

import asyncio
from typing import cast

import zmq
import zmq.asyncio


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
    """Non-blocking send; False when ZeroMQ would block (the outcome is on the returned future)."""
    future = cast("asyncio.Future[object]", sock.send_multipart(frames, flags=zmq.NOBLOCK))
    if not future.done():
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return True
    return future.exception() is None
