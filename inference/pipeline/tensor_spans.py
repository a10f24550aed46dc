"""Where each input tensor's ``raw_data`` lies in the bytes of a serialized ``InferRequest``.

The gateway holds each request twice: parsed (upb) and as the bytes it arrived in (a view of the ZeroMQ
frame). Asking the parsed request for ``raw_data`` copies it; :func:`raw_data_views` finds the same bytes in
the request's encoding (edgewire/scan.py) and hands out read-only views of them. The encoding is read the
way protobuf reads it (of a field written twice the last one counts, a repeated field's pieces add up,
a field of an unexpected wire type is an unknown field), and what it says is checked against the parsed
request (request id, the inputs' count, names, datatypes and shapes): bytes that do not hold that request
give None, and the caller decodes the parsed request as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from edgewire import pb
from edgewire.scan import (
    Buffer,
    WireScanError,
    WireType,
    as_bytes_view,
    as_int64,
    field_spans,
    packed_varints,
)

_REQUEST: Final = pb.InferRequest.DESCRIPTOR.fields_by_name
_TENSOR: Final = pb.Tensor.DESCRIPTOR.fields_by_name
_REQUEST_ID: Final = _REQUEST["request_id"].number
_INPUTS: Final = _REQUEST["inputs"].number
_NAME: Final = _TENSOR["name"].number
_DATATYPE: Final = _TENSOR["datatype"].number
_SHAPE: Final = _TENSOR["shape"].number
_RAW_DATA: Final = _TENSOR["raw_data"].number
_EMPTY: Final = memoryview(b"")
_VARINT: Final = int(WireType.VARINT)  # plain ints: an IntEnum member is slow to look up on Python 3.11
_LEN: Final = int(WireType.LEN)
_U64: Final = 1 << 64
_I64_SIGN: Final = 1 << 63


class WireTensor(NamedTuple):
    """One input tensor as its encoding says: name, datatype, shape, and a read-only view of its raw_data."""

    name: bytes
    datatype: int
    shape: list[int]
    raw_data: memoryview


def scan_tensor(data: memoryview) -> WireTensor:
    """The fields of one encoded ``Tensor`` (a flat byte view); raises ``WireScanError``."""
    name = b""
    datatype = 0
    shape: list[int] = []
    raw_data = _EMPTY
    for number, kind, value, start, stop in field_spans(data):
        if number == _RAW_DATA and kind == _LEN:
            raw_data = data[start:stop]
        elif number == _SHAPE and kind == _LEN:
            shape += [v - _U64 if v >= _I64_SIGN else v for v in packed_varints(data[start:stop])]
        elif number == _SHAPE and kind == _VARINT:
            shape.append(as_int64(value))
        elif number == _DATATYPE and kind == _VARINT:
            low = value & 0xFFFFFFFF  # an enum is an int32: the varint's low 32 bits, two's complement
            datatype = low - (1 << 32) if low >= 1 << 31 else low
        elif number == _NAME and kind == _LEN:
            name = bytes(data[start:stop])
    return WireTensor(name, datatype, shape, raw_data.toreadonly())


def scan_request(raw: Buffer) -> tuple[bytes, list[WireTensor]]:
    """The request id and the input tensors of one encoded ``InferRequest``; raises ``WireScanError``."""
    view = as_bytes_view(raw)
    request_id = b""
    inputs: list[WireTensor] = []
    for number, kind, _, start, stop in field_spans(view):
        if kind != _LEN:
            continue
        if number == _INPUTS:
            inputs.append(scan_tensor(view[start:stop]))
        elif number == _REQUEST_ID:
            request_id = bytes(view[start:stop])
    return request_id, inputs


def wire_inputs(request: pb.InferRequest, raw: Buffer) -> list[WireTensor] | None:
    """``request.inputs`` as read off ``raw`` (the request's encoding), their raw_data read-only views of
    it; None when ``raw`` is malformed or does not encode ``request``."""
    try:
        request_id, scanned = scan_request(raw)
    except WireScanError:
        return None
    parsed: Sequence[pb.Tensor] = request.inputs
    if request_id != request.request_id or len(scanned) != len(parsed):
        return None
    for wire, tensor in zip(scanned, parsed, strict=True):
        if (
            wire.datatype != tensor.datatype
            or wire.name != tensor.name.encode()
            or wire.shape != list(tensor.shape)
        ):
            return None
    return scanned


def raw_data_views(request: pb.InferRequest, raw: Buffer) -> list[memoryview] | None:
    """``request.inputs[i].raw_data`` for each i, as read-only views of ``raw`` (the request's encoding),
    or None when ``raw`` is malformed or does not encode ``request``."""
    wires = wire_inputs(request, raw)
    return None if wires is None else [wire.raw_data for wire in wires]
