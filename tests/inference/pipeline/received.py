"""Test helper: requests sent as a real frame over ZeroMQ on loopback, as the gateway receives them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from edgewire import FrameCodec, pb
from edgewire.scan import fields

_REQUESTS = pb.RequestBatch.DESCRIPTOR.fields_by_name["requests"].number


@dataclass
class Received:
    """A received RequestBatch: the parsed requests, each one's bytes, and the ZeroMQ frame they are in."""

    requests: list[pb.InferRequest]
    payloads: list[memoryview]
    frame: zmq.Frame

    def frame_bytes(self) -> np.ndarray:
        """The frame's buffer as a numpy array (for ``np.shares_memory``)."""
        return np.frombuffer(self.frame.buffer, dtype=np.uint8)


class Loopback:
    """A PAIR of sockets over TCP on 127.0.0.1; ``send`` returns what the far end received, zero-copy."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sender = self.context.socket(zmq.PAIR)
        self.receiver = self.context.socket(zmq.PAIR)
        for sock in (self.sender, self.receiver):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
        port = self.receiver.bind_to_random_port("tcp://127.0.0.1")
        self.sender.connect(f"tcp://127.0.0.1:{port}")
        self.codec = FrameCodec()

    def send(self, requests: Sequence[pb.InferRequest]) -> Received:
        """Encode ``requests`` as one uncompressed frame, send it, and decode it where it arrived."""
        frames = self.codec.encode(pb.RequestBatch(requests=requests), agent_id="t", compress=False)
        self.sender.send_multipart(frames, copy=False)
        header, body = self.receiver.recv_multipart(copy=False)
        envelope = self.codec.decode_envelope([header.buffer, body.buffer])
        assert envelope.codec == pb.CODEC_NONE
        batch, raw = self.codec.decode_payload_bytes(envelope, body.buffer)
        assert isinstance(batch, pb.RequestBatch)
        payloads = [f.data for f in fields(raw) if f.number == _REQUESTS]
        return Received(list(batch.requests), payloads, body)

    def close(self) -> None:
        self.sender.close(0)
        self.receiver.close(0)
        self.context.term()


def loopback() -> Iterator[Loopback]:
    """Fixture body: a :class:`Loopback`, closed afterwards."""
    pair = Loopback()
    try:
        yield pair
    finally:
        pair.close()
