"""The fields of a serialized protobuf message, read off its bytes: each a span of the buffer, no copies.

Parsing a message with upb copies every ``bytes`` field it is asked for into a new Python object; a wire
tensor's ``raw_data`` (a 301 KB image) would be copied before it is even looked at. :func:`fields` walks
the encoding instead (tag, wire type, then a varint, a fixed-width value or a length-delimited span) and
hands out ``memoryview`` slices of the caller's buffer. Nested messages are spans too: scan them in turn.

Only the protobuf encoding is checked (varints of at most 10 bytes, field numbers 1 to 2**29 - 1, the six
wire types, lengths that stay inside the buffer); what the fields mean is the caller's business. Groups
(wire types 3 and 4, proto2 only) are refused: no schema here has one. Every refusal is a
:class:`WireScanError` naming the offset. The walk is bounded by the buffer: every field takes at least two
bytes, and nothing recurses.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

Buffer = bytes | bytearray | memoryview

MAX_VARINT_BYTES: Final = 10
"""A 64-bit value takes at most ten 7-bit groups."""
MAX_FIELD_NUMBER: Final = (1 << 29) - 1
_U64: Final = 1 << 64


class WireType(enum.IntEnum):
    """The wire types of the protobuf encoding (the low three bits of a tag)."""

    VARINT = 0
    I64 = 1
    LEN = 2
    SGROUP = 3
    EGROUP = 4
    I32 = 5


class WireScanError(ValueError):
    """Bytes that are not a well-formed protobuf encoding; ``offset`` is where the scan found it out."""

    def __init__(self, detail: str, offset: int) -> None:
        super().__init__(f"{detail} (at byte {offset})")
        self.detail = detail
        self.offset = offset


@dataclass(frozen=True, slots=True)
class WireField:
    """One field as encoded: its number and wire type, and ``data``, the span of its value in the buffer.

    ``value`` is the varint (VARINT, unsigned, as encoded), the little-endian unsigned integer (I64, I32),
    or the length of ``data`` (LEN).
    """

    number: int
    wire_type: WireType
    value: int
    data: memoryview


def as_bytes_view(buffer: Buffer) -> memoryview:
    """``buffer`` as a flat memoryview of unsigned bytes (the same memory; refused if not contiguous)."""
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise WireScanError("buffer is not contiguous", 0)
    return view.cast("B")


def read_varint(view: memoryview, offset: int) -> tuple[int, int]:
    """The unsigned varint at ``offset`` of ``view`` and the offset just past it."""
    end = len(view)
    value = 0
    shift = 0
    position = offset
    while True:
        if position >= end:
            raise WireScanError("varint runs past the end of the buffer", offset)
        if position - offset == MAX_VARINT_BYTES:
            raise WireScanError(f"varint longer than {MAX_VARINT_BYTES} bytes", offset)
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    if value >= _U64:
        raise WireScanError("varint over 64 bits", offset)
    return value, position


def as_int64(value: int) -> int:
    """An encoded varint read as a signed 64-bit integer (int64, int32 and enums: two's complement)."""
    return value - _U64 if value >= 1 << 63 else value


def fields(buffer: Buffer) -> Iterator[WireField]:
    """Each field of the message encoded in ``buffer``, in the order it was written (repeats included).

    Raises :class:`WireScanError` at the first malformed field; fields before it have been yielded.
    """
    view = as_bytes_view(buffer)
    end = len(view)
    offset = 0
    while offset < end:
        tag, position = read_varint(view, offset)
        number, kind = tag >> 3, tag & 7
        if not 1 <= number <= MAX_FIELD_NUMBER:
            raise WireScanError(f"field number {number} out of range", offset)
        if kind == WireType.VARINT:
            value, stop = _value_varint(view, position, number, offset)
        elif kind == WireType.LEN:
            value, start = _value_varint(view, position, number, offset)
            if value > end - start:
                raise WireScanError(
                    f"field {number}: length {value} runs past the end ({end - start} bytes left)", offset
                )
            position, stop = start, start + value
        elif kind in (WireType.I64, WireType.I32):
            width = 8 if kind == WireType.I64 else 4
            stop = position + width
            if stop > end:
                raise WireScanError(f"field {number}: fixed {width}-byte value runs past the end", offset)
            value = int.from_bytes(view[position:stop], "little")
        elif kind in (WireType.SGROUP, WireType.EGROUP):
            raise WireScanError(f"field {number}: groups (wire type {kind}) are not supported", offset)
        else:
            raise WireScanError(f"field {number}: unknown wire type {kind}", offset)
        yield WireField(number, WireType(kind), value, view[position:stop])
        offset = stop


def _value_varint(view: memoryview, position: int, number: int, field_offset: int) -> tuple[int, int]:
    """A field's varint value (or length): a refusal names the field and the offset of its tag."""
    try:
        return read_varint(view, position)
    except WireScanError as exc:
        raise WireScanError(f"field {number}: {exc.detail}", field_offset) from None


def packed_varints(data: Buffer) -> list[int]:
    """The unsigned varints a packed repeated field holds, end to end in ``data``."""
    view = as_bytes_view(data)
    values: list[int] = []
    offset = 0
    while offset < len(view):
        value, offset = read_varint(view, offset)
        values.append(value)
    return values
