"""request_spans finds each request's own bytes in a RequestBatch payload, or says it cannot."""

from __future__ import annotations

from edgewire import pb
from gateway.frames.wire import request_spans


def _batch() -> pb.RequestBatch:
    return pb.RequestBatch(
        requests=[
            pb.InferRequest(
                request_id=bytes([n]) * 16, model_name="rank-mlp", text=pb.TextQuery(text="x" * n)
            )
            for n in range(1, 200, 37)
        ]
    )


def test_each_span_is_that_request_and_a_view_of_the_payload() -> None:
    batch = _batch()
    payload = memoryview(batch.SerializeToString())
    parsed = pb.RequestBatch.FromString(payload)
    spans = request_spans(payload, parsed.requests)
    assert spans is not None
    assert [bytes(s) for s in spans] == [r.SerializeToString() for r in batch.requests]
    assert all(s.obj is payload.obj for s in spans)  # views, not copies


def test_a_payload_with_more_than_requests_is_not_split() -> None:
    batch = _batch()
    extra = batch.SerializeToString() + b"\x10\x01"  # an unknown varint field 2 after the requests
    parsed = pb.RequestBatch.FromString(extra)
    assert request_spans(memoryview(extra), parsed.requests) is None


def test_a_malformed_payload_is_not_split() -> None:
    batch = _batch()
    data = batch.SerializeToString()
    assert request_spans(memoryview(data[:-3]), batch.requests) is None
