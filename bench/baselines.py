"""Transport baselines for the ingest benchmark, each a server process and a client in this process.

Each moves the same serialized ``InferRequest`` bytes, one message per request, as fast as Python can:

* ``pyzmq``: PUSH -> PULL, one message per frame (the Python-loop limit of ZeroMQ without batching);
* ``grpc``: one bidirectional stream, a 1-byte acknowledgement back per message (generic handler, no codegen);
* ``http``: one HTTP/JSON POST per request (aiohttp on both sides, keep-alive, 16 in flight), the server
  parsing the JSON and answering JSON: the "Flask wrapper" the seeds started from.

Every loop is bounded by a count and a time, and every server binds 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import zmq

from gateway.testing_servers import free_port

MAX_MESSAGES = 5_000_000
_METHOD = "/bench.Ingest/Stream"


def _pull_server(endpoint: str, results: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.bind(endpoint)
    count, first = 0, 0.0
    while True:
        message = sock.recv(copy=False)
        if count == 0:
            first = time.perf_counter()
        if message.bytes == b"END":
            break
        count += 1
    results.put((count, time.perf_counter() - first))
    sock.close(0)
    ctx.term()


def pyzmq_push_pull(payloads: Sequence[bytes], seconds: float) -> float:
    """Messages per second received by a PULL process, one request per message."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = context.Process(target=_pull_server, args=(endpoint, results), daemon=True)
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    time.sleep(0.5)  # the server's import and bind
    end = time.perf_counter() + seconds
    sent = 0
    n = len(payloads)
    while sent < MAX_MESSAGES and time.perf_counter() < end:
        for i in range(1000):
            sock.send(payloads[(sent + i) % n], copy=True)
        sent += 1000
    sock.send(b"END")
    count, elapsed = results.get(timeout=60)
    sock.close(0)
    ctx.term()
    server.join(10)
    return float(count / elapsed)


def _start(target: Callable[[int, Any], None]) -> tuple[int, Any]:
    """A baseline server process on a free loopback port, once it says it is ready."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    port = free_port()
    server = context.Process(target=target, args=(port, ready), daemon=True)
    server.start()
    if not ready.wait(30):
        server.terminate()
        raise RuntimeError(f"baseline server {target.__name__} did not start")
    return port, server


def _grpc_server(port: int, ready: Any) -> None:
    from concurrent import futures

    def stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in requests:
            yield b"\x01"

    handler = grpc.method_handlers_generic_handler(
        "bench.Ingest",
        {"Stream": grpc.stream_stream_rpc_method_handler(stream)},  # bytes in, bytes out: no (de)serializers
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def grpc_stream(payloads: Sequence[bytes], seconds: float) -> float:
    """Messages per second through one bidirectional stream, each acknowledged by the server."""
    port, server = _start(_grpc_server)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.stream_stream(_METHOD)
        n = len(payloads)
        end = time.perf_counter() + seconds

        def requests() -> Iterator[bytes]:
            i = 0
            while i < MAX_MESSAGES and time.perf_counter() < end:
                yield payloads[i % n]
                i += 1

        start = time.perf_counter()
        acks = sum(1 for _ in call(requests()))
        elapsed = time.perf_counter() - start
        channel.close()
        return acks / elapsed
    finally:
        server.terminate()
        server.join(10)


def _http_server(port: int, ready: Any) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        return web.json_response({"request_id": body.get("request_id", ""), "accepted": True})

    app = web.Application()
    app.router.add_post("/infer", infer)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def http_json(documents: Sequence[str], seconds: float, concurrency: int = 16) -> float:
    """Requests per second, one JSON POST per request, ``concurrency`` in flight on keep-alive connections."""
    import aiohttp

    port, server = _start(_http_server)
    try:

        async def drive() -> tuple[int, float]:
            url = f"http://127.0.0.1:{port}/infer"
            done = 0
            end = time.perf_counter() + seconds
            connector = aiohttp.TCPConnector(limit=concurrency)
            async with aiohttp.ClientSession(connector=connector) as session:

                async def worker(offset: int) -> None:
                    nonlocal done
                    i = offset
                    while done < MAX_MESSAGES and time.perf_counter() < end:
                        headers = {"Content-Type": "application/json"}
                        async with session.post(
                            url, data=documents[i % len(documents)], headers=headers
                        ) as r:
                            await r.read()
                        done += 1
                        i += concurrency

                start = time.perf_counter()
                await asyncio.gather(*(worker(k) for k in range(concurrency)))
                return done, time.perf_counter() - start

        done, elapsed = asyncio.run(drive())
        return done / elapsed
    finally:
        server.terminate()
        server.join(10)
