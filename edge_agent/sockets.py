"""Sends on ZeroMQ sockets that never wait: the agent's one loop must not stall on a slow peer."""

from __future__ import annotations

import zmq
import zmq.asyncio

from edgewire.parts import send_parts


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
    """Non-blocking send; False when ZeroMQ would block or refuses it (a peer not connected,
    ROUTER_MANDATORY's unknown peer). Every send of the agent's goes through here and none waits, so none
    is queued behind another.

    The parts go through the backend's send (edgewire.parts: pyzmq's asyncio ``send_multipart`` cost 7-11
    us a frame here, this 4-5, the check below included). A send may process ZeroMQ's commands and so take
    in the edge of the socket's file descriptor that a message for the awaited ``recv`` would have raised:
    reading ``EVENTS`` through the asyncio socket has it wake that ``recv`` if a message waits (as pyzmq's
    own send does when a ``recv`` is pending)."""
    try:
        send_parts(sock, frames)
    except zmq.ZMQError:
        return False
    finally:
        sock.get(zmq.EVENTS)
    return True
