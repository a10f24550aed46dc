"""Where each request of a RequestBatch lies in the payload it was parsed from.

The CPU stage's workers take a batch's requests as bytes. They are the bytes the frame brought: a
request's encoding is found in the payload instead of serialized again. A RequestBatch holds nothing but
field 1 (requests), each a tag byte, a varint length and the request. Protobuf's encoding of a message is
never shorter than ``ByteSize()`` (the canonical size); so when the canonical sizes with their headers add
up to the payload's length exactly, every request is encoded canonically, back to back, at the offsets the
sizes give. Anything else (unknown fields, a sender's non-canonical encoding) is answered None and the
requests are serialized as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgewire import pb

_TAG = 0x0A  # field 1, length-delimited


def _varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size


def request_spans(payload: memoryview, requests: Sequence[pb.InferRequest]) -> list[memoryview] | None:
    """Each request's own bytes within ``payload`` (views, no copies), or None when they cannot be told."""
    spans: list[memoryview] = []
    cursor = 0
    end = len(payload)
    for request in requests:
        size = request.ByteSize()
        start = cursor + 1 + _varint_size(size)
        if start + size > end or payload[cursor] != _TAG:
            return None
        spans.append(payload[start : start + size])
        cursor = start + size
    return spans if cursor == end else None
