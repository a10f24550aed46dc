"""send_nowait on real ZeroMQ sockets: what it sends arrives whole, it refuses without waiting, and a send
does not leave an awaited recv asleep when ZeroMQ took in that recv's wake-up while sending."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import zmq
import zmq.asyncio

from edge_agent.sockets import send_nowait


@asynccontextmanager
async def pair() -> AsyncIterator[tuple[zmq.asyncio.Socket, zmq.Socket[bytes]]]:
    """An asyncio DEALER (the agent's side) and a plain DEALER peer, over inproc."""
    ctx = zmq.asyncio.Context()
    ours = ctx.socket(zmq.DEALER)
    ours.setsockopt(zmq.LINGER, 0)
    ours.bind(f"inproc://send-nowait-{id(ours)}")
    peer = zmq.Socket(ctx, zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"inproc://send-nowait-{id(ours)}")
    try:
        yield ours, peer
    finally:
        ours.close(0)
        peer.close(0)
        ctx.term()


async def test_the_parts_arrive_as_one_message_and_a_full_peer_is_refused_at_once() -> None:
    async with pair() as (ours, peer):
        assert send_nowait(ours, [b"envelope", b"payload"])
        assert peer.poll(5000)
        assert peer.recv_multipart() == [b"envelope", b"payload"]
        ours.setsockopt(zmq.SNDHWM, 1)
        peer.setsockopt(zmq.RCVHWM, 1)
        sent = 0
        while send_nowait(ours, [b"x" * 1000]) and sent < 100_000:
            sent += 1
        assert 0 < sent < 100_000  # the queues filled, and the next send was refused (returned), not waited


async def test_a_send_wakes_the_awaited_recv_whose_wake_up_it_took_in() -> None:
    """A message for the agent's socket arrives while the loop is busy (no await between), and the agent
    then sends on that socket: ZeroMQ processes the pending commands in the send, so the file descriptor's
    wake-up is spent and the loop would never see it; the awaited recv still gets the message."""
    async with pair() as (ours, peer):
        receiving = ours.recv_multipart()  # a future, waiting on the socket's file descriptor from here
        peer.send(b"for the agent")  # inproc: in our pipe, its wake-up pending, once send returns
        assert send_nowait(ours, [b"from the agent"])  # no await since: the loop has not seen the wake-up
        assert await asyncio.wait_for(receiving, timeout=2.0) == [b"for the agent"]
        assert peer.poll(5000)
        assert peer.recv_multipart() == [b"from the agent"]
