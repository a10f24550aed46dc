"""Where each request of a RequestBatch lies in the payload it was parsed from.

The CPU stage's workers take a batch's requests as bytes, and the tensor pipeline reads tensors in place:
both get the bytes the frame brought, found in the payload (edgewire/scan.py walks its fields as views)
instead of serialized again. A RequestBatch holds nothing but field 1 (requests), one length-delimited
field per request, in order; a payload that holds anything else, or a different number of them than the
parse found, is answered None (the requests are then serialized as before).
"""

from __future__ import annotations

from collections.abc import Sequence

from edgewire import pb
from edgewire.scan import WireScanError, field_spans

_REQUESTS = pb.RequestBatch.DESCRIPTOR.fields_by_name["requests"].number
_LEN = 2


def request_spans(payload: memoryview, requests: Sequence[pb.InferRequest]) -> list[memoryview] | None:
    """Each request's own bytes within ``payload`` (views, no copies), or None when they cannot be told."""
    try:
        found = field_spans(payload)
    except WireScanError:
        return None
    if len(found) != len(requests):
        return None
    spans: list[memoryview] = []
    for number, kind, _, start, stop in found:
        if number != _REQUESTS or kind != _LEN:
            return None
        spans.append(payload[start:stop])
    return spans
