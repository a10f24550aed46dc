"""The fields of a serialized protobuf message, read off its bytes: where each one lies, no copies.

Parsing a message with upb copies every ``bytes`` field it is asked for into a new Python object; a wire
tensor's ``raw_data`` (a 301 KB image) would be copied before it is even looked at. :func:`field_spans`
walks the encoding instead (tag, wire type, then a varint, a fixed-width value or a length-delimited
value) and says where each field's value lies in the buffer; :func:`fields` hands the same out with the
values as ``memoryview`` slices of the caller's buffer. Nested messages are spans too: scan them in turn.

Only the protobuf encoding is checked (varints of at most 10 bytes, field numbers 1 to 2**29 - 1, the six
wire types, lengths that stay inside the buffer); what the fields mean is the caller's business. Groups
(wire types 3 and 4, proto2 only) are refused: no schema here has one. Every refusal is a
:class:`WireScanError` naming the offset of the field at fault. The walk is bounded by the buffer: every
field takes at least two bytes, and nothing recurses.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Final, NamedTuple, TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview

MAX_VARINT_BYTES: Final = 10
"""A 64-bit value takes at most ten 7-bit groups."""
MAX_FIELD_NUMBER: Final = (1 << 29) - 1
_U64: Final = 1 << 64

FieldSpan: TypeAlias = tuple[int, int, int, int, int]
"""(field number, wire type, value, start, stop): the field's value is ``buffer[start:stop]``; ``value``
is the varint (VARINT), the little-endian unsigned integer (I64, I32), or the length (LEN)."""


class WireType(enum.IntEnum):
    """The wire types of the protobuf encoding (the low three bits of a tag)."""

    VARINT = 0
    I64 = 1
    LEN = 2
    SGROUP = 3
    EGROUP = 4
    I32 = 5


# The hot loops compare plain ints: an IntEnum member costs ~0.25 us per access on Python 3.11.
_LEN: Final = int(WireType.LEN)
_VARINT_OR_LEN: Final = frozenset({int(WireType.VARINT), _LEN})


class WireScanError(ValueError):
    """Bytes that are not a well-formed protobuf encoding; ``offset`` is where the scan found it out."""

    def __init__(self, detail: str, offset: int) -> None:
        super().__init__(f"{detail} (at byte {offset})")
        self.detail = detail
        self.offset = offset


class WireField(NamedTuple):
    """One field as encoded: its number, wire type and value (as in :data:`FieldSpan`), and ``data``, the
    bytes of its value as a view of the buffer."""

    number: int
    wire_type: int  # a WireType value
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
    limit = min(end, offset + MAX_VARINT_BYTES)
    value = 0
    shift = 0
    position = offset
    while position < limit:
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= _U64:
                raise WireScanError("varint over 64 bits", offset)
            return value, position
        shift += 7
    if position >= end:
        raise WireScanError("varint runs past the end of the buffer", offset)
    raise WireScanError(f"varint longer than {MAX_VARINT_BYTES} bytes", offset)


def as_int64(value: int) -> int:
    """An encoded varint read as a signed 64-bit integer (int64, int32 and enums: two's complement)."""
    return value - _U64 if value >= 1 << 63 else value


def field_spans(buffer: Buffer) -> list[FieldSpan]:
    """Every field of the message encoded in ``buffer``, in the order it was written (repeats included).

    Raises :class:`WireScanError` at the first malformed field. Plain tuples in a list, one-byte tags and
    one- and two-byte values and lengths read inline: a request's scan costs a few microseconds, not the
    copy it saves.
    """
    view = as_bytes_view(buffer)
    end = len(view)
    found: list[FieldSpan] = []
    offset = 0
    while offset < end:
        tag = view[offset]
        position = offset + 1
        if tag >= 0x80:
            tag, position = read_varint(view, offset)
        number, kind = tag >> 3, tag & 7
        if number == 0 or number > MAX_FIELD_NUMBER:
            raise WireScanError(f"field number {number} out of range", offset)
        if kind in _VARINT_OR_LEN:
            if position < end and view[position] < 0x80:
                value, stop = view[position], position + 1
            elif position + 1 < end and view[position + 1] < 0x80:  # two bytes: a request's length, mostly
                value, stop = (view[position] & 0x7F) | view[position + 1] << 7, position + 2
            else:
                value, stop = _value_varint(view, position, number, offset)
            if kind == _LEN:
                position, stop = stop, stop + value
                if stop > end:
                    raise WireScanError(
                        f"field {number}: length {value} runs past the end ({end - position} bytes left)",
                        offset,
                    )
        else:
            value, stop = _fixed(view, position, number, kind, offset)
        found.append((number, kind, value, position, stop))
        offset = stop
    return found


def fields(buffer: Buffer) -> Iterator[WireField]:
    """:func:`field_spans`, each value as a view of ``buffer``; raises before yielding when malformed."""
    view = as_bytes_view(buffer)
    for number, kind, value, start, stop in field_spans(view):
        yield WireField(number, kind, value, view[start:stop])


def _value_varint(view: memoryview, position: int, number: int, field_offset: int) -> tuple[int, int]:
    """A field's varint value (or length): a refusal names the field and the offset of its tag."""
    try:
        return read_varint(view, position)
    except WireScanError as exc:
        raise WireScanError(f"field {number}: {exc.detail}", field_offset) from None


def _fixed(view: memoryview, position: int, number: int, kind: int, field_offset: int) -> tuple[int, int]:
    """A fixed-width field's value and where it ends; groups and unknown wire types are refused here."""
    if kind in (WireType.SGROUP, WireType.EGROUP):
        raise WireScanError(f"field {number}: groups (wire type {kind}) are not supported", field_offset)
    if kind not in (WireType.I64, WireType.I32):
        raise WireScanError(f"field {number}: unknown wire type {kind}", field_offset)
    width = 8 if kind == WireType.I64 else 4
    stop = position + width
    if stop > len(view):
        raise WireScanError(f"field {number}: fixed {width}-byte value runs past the end", field_offset)
    return int.from_bytes(view[position:stop], "little"), stop


def packed_varints(data: Buffer) -> list[int]:
    """The unsigned varints a packed repeated field holds, end to end in ``data``."""
    view = as_bytes_view(data)
    values: list[int] = []
    append = values.append
    offset = 0
    end = len(view)
    while offset < end:
        byte = view[offset]
        if byte < 0x80:  # one byte (0-127) or two (128-16383, a 224 x 224 image's dims): inline
            append(byte)
            offset += 1
        elif offset + 1 < end and view[offset + 1] < 0x80:
            append((byte & 0x7F) | view[offset + 1] << 7)
            offset += 2
        else:
            value, offset = read_varint(view, offset)
            append(value)
    return values
