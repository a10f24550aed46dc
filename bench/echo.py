"""The baseline peer: a ROUTER that sends every multipart message straight back (raw pyzmq, no decoding).

python -m bench.echo tcp://127.0.0.1:6000
"""

from __future__ import annotations

import sys

import zmq


def bound_router(endpoint: str) -> zmq.Socket[bytes]:
    """A ROUTER bound on ``endpoint`` with deep queues; its address printed for bench.gateway_bench.Peer."""
    sock: zmq.Socket[bytes] = zmq.Context().socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVHWM, 20000)
    sock.setsockopt(zmq.SNDHWM, 20000)
    sock.bind(endpoint)
    print(sock.get_string(zmq.LAST_ENDPOINT), flush=True)
    return sock


def serve(endpoint: str) -> None:
    sock = bound_router(endpoint)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:*")
