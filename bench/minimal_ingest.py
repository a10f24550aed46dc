"""The floor of any Python ingest: what one process does with the gateway's frames when it does nothing else.

    python -m bench.minimal_ingest [tcp://127.0.0.1:*]

A ROUTER that, per RequestBatch frame, runs the shared codec's checks and decode (zstd, protobuf), keeps
each request id in a bounded dedupe set, sends the Ack with the accepted ids, and answers every request
with an empty OK response in one ResponseBatch frame. No routing, no queues or batching, no pipelines, no
model, no metrics. bench/ingest_bench.py drives it with the same frames and driver as the gateway: the gap
between the two is what the gateway's features cost per request, not Python's floor.
"""

from __future__ import annotations

import sys
from collections import OrderedDict

from bench.echo import bound_router
from edgewire import FrameCodec, FrameError, Serialized, pb, repeated_field

RESPONSES = pb.ResponseBatch.DESCRIPTOR.fields_by_name["responses"].number
DEDUPE_MAX = 1_000_000


def serve(endpoint: str) -> None:
    sock = bound_router(endpoint)
    codec = FrameCodec()
    seen: OrderedDict[bytes, None] = OrderedDict()
    while True:
        routing_id, *body = sock.recv_multipart(copy=False)
        try:
            decoded = codec.decode([frame.bytes for frame in body])
        except FrameError:
            continue
        batch = decoded.payload
        if not isinstance(batch, pb.RequestBatch):
            continue
        ack = pb.Ack(acked_message_id=decoded.envelope.message_id)
        answers = []
        for request in batch.requests:
            rid = request.request_id
            if rid in seen:
                ack.duplicate_ids.append(rid)
                continue
            seen[rid] = None
            if len(seen) > DEDUPE_MAX:
                seen.popitem(last=False)
            ack.accepted_ids.append(rid)
            answers.append(pb.InferResponse(request_id=rid, status=pb.STATUS_OK).SerializeToString())
        rid_bytes = routing_id.bytes
        sock.send_multipart([rid_bytes, *codec.encode(ack, agent_id="hk", region="hk")])
        frames = codec.encode(
            Serialized(pb.MESSAGE_KIND_RESPONSE_BATCH, repeated_field(RESPONSES, answers), len(answers)),
            agent_id=decoded.envelope.agent_id,
            region="hk",
            dict_id=0,
        )
        sock.send_multipart([rid_bytes, *frames])


if __name__ == "__main__":
    serve(sys.argv[1] if len(sys.argv) > 1 else "tcp://127.0.0.1:*")
