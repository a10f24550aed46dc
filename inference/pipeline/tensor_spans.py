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
from dataclasses import dataclass, field
from typing import Final

from edgewire import pb
from edgewire.scan import Buffer, WireScanError, WireType, as_int64, fields, packed_varints

_REQUEST: Final = pb.InferRequest.DESCRIPTOR.fields_by_name
_TENSOR: Final = pb.Tensor.DESCRIPTOR.fields_by_name
_REQUEST_ID: Final = _REQUEST["request_id"].number
_INPUTS: Final = _REQUEST["inputs"].number
_NAME: Final = _TENSOR["name"].number
_DATATYPE: Final = _TENSOR["datatype"].number
_SHAPE: Final = _TENSOR["shape"].number
_RAW_DATA: Final = _TENSOR["raw_data"].number
_EMPTY: Final = memoryview(b"")


@dataclass(slots=True)
class WireTensor:
    """One input tensor as its encoding says: name, datatype, shape, and a view of its raw_data."""

    name: bytes = b""
    datatype: int = 0
    shape: list[int] = field(default_factory=list)
    raw_data: memoryview = _EMPTY


def _as_int32(value: int) -> int:
    """A varint as an int32 field (an enum) keeps it: its low 32 bits, two's complement."""
    low = value & 0xFFFFFFFF
    return low - (1 << 32) if low >= 1 << 31 else low


def scan_tensor(data: Buffer) -> WireTensor:
    """The fields of one encoded ``Tensor``; raises :class:`~edgewire.scan.WireScanError`."""
    tensor = WireTensor()
    for item in fields(data):
        number, kind = item.number, item.wire_type
        if number == _RAW_DATA and kind == WireType.LEN:
            tensor.raw_data = item.data
        elif number == _SHAPE and kind == WireType.LEN:
            tensor.shape.extend(as_int64(v) for v in packed_varints(item.data))
        elif number == _SHAPE and kind == WireType.VARINT:
            tensor.shape.append(as_int64(item.value))
        elif number == _DATATYPE and kind == WireType.VARINT:
            tensor.datatype = _as_int32(item.value)
        elif number == _NAME and kind == WireType.LEN:
            tensor.name = bytes(item.data)
    return tensor


def scan_request(raw: Buffer) -> tuple[bytes, list[WireTensor]]:
    """The request id and the input tensors of one encoded ``InferRequest``; raises ``WireScanError``."""
    request_id: memoryview = _EMPTY
    inputs: list[WireTensor] = []
    for item in fields(raw):
        if item.wire_type != WireType.LEN:
            continue
        if item.number == _INPUTS:
            inputs.append(scan_tensor(item.data))
        elif item.number == _REQUEST_ID:
            request_id = item.data
    return bytes(request_id), inputs


def raw_data_views(request: pb.InferRequest, raw: Buffer) -> list[memoryview] | None:
    """``request.inputs[i].raw_data`` for each i, as read-only views of ``raw`` (the request's encoding),
    or None when ``raw`` is malformed or does not encode ``request``."""
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
    return [wire.raw_data.toreadonly() for wire in scanned]
