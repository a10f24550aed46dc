"""The wire scanner reads fields off a message's bytes as protobuf wrote them, and refuses malformed bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgewire import pb
from edgewire.scan import (
    WireScanError,
    WireType,
    as_int64,
    fields,
    packed_varints,
    read_varint,
)
from tests.edgewire.strategies import requests, tensors


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def test_fields_of_a_tensor_are_spans_of_its_bytes() -> None:
    """Each field of an encoded Tensor: number, wire type, value, and its bytes as a view of the buffer."""
    raw = bytearray(
        pb.Tensor(
            name="images", datatype=pb.DATA_TYPE_FP16, shape=[1, 3], raw_data=b"\x01\x02"
        ).SerializeToString()
    )
    found = list(fields(raw))
    assert [(f.number, f.wire_type) for f in found] == [
        (1, WireType.LEN),
        (2, WireType.VARINT),
        (3, WireType.LEN),
        (4, WireType.LEN),
    ]
    assert bytes(found[0].data) == b"images"
    assert found[1].value == pb.DATA_TYPE_FP16
    assert packed_varints(found[2].data) == [1, 3]
    assert (found[3].value, bytes(found[3].data)) == (2, b"\x01\x02")
    raw[-1] = 0x09  # the span is the buffer's own memory, not a copy of it
    assert bytes(found[3].data) == b"\x01\x09"


def test_fixed_width_fields_are_read_little_endian() -> None:
    """A float field (I32) and a double-width value (I64) come with their bytes as an unsigned integer."""
    (hint,) = fields(pb.InferRequest(complexity_hint=0.5).SerializeToString())
    assert hint.wire_type == WireType.I32
    assert np.frombuffer(hint.data, "<f4")[0] == 0.5
    assert hint.value == int.from_bytes(np.float32(0.5).tobytes(), "little")
    (wide,) = fields(b"\x09" + (7).to_bytes(8, "little"))
    assert (wide.number, wide.wire_type, wide.value) == (1, WireType.I64, 7)


def test_negative_int64_reads_as_ten_byte_twos_complement() -> None:
    """shape = [-1] is encoded in ten bytes; as_int64 turns the varint back into -1."""
    (shape,) = fields(pb.Tensor(shape=[-1]).SerializeToString())
    assert len(shape.data) == 10
    assert [as_int64(v) for v in packed_varints(shape.data)] == [-1]


@given(st.integers(0, (1 << 64) - 1))
def test_varints_round_trip(value: int) -> None:
    """Every 64-bit value reads back from its encoding, and the offset lands just past it."""
    encoded = varint(value) + b"\xff"
    assert read_varint(memoryview(encoded), 0) == (value, len(encoded) - 1)


@given(requests)
def test_fields_agree_with_protobuf(request: pb.InferRequest) -> None:
    """Scanning any request finds what protobuf wrote: its inputs' names and raw_data in order."""
    raw = request.SerializeToString()
    inputs = [f for f in fields(raw) if f.number == 8]
    assert len(inputs) == len(request.inputs)
    for found, tensor in zip(inputs, request.inputs, strict=True):
        assert bytes(found.data) == tensor.SerializeToString()
        by_number = {f.number: f for f in fields(found.data)}
        assert (bytes(by_number[4].data) if 4 in by_number else b"") == tensor.raw_data


@given(tensors, st.data())
def test_a_truncated_message_is_refused_or_read_short_never_past_its_end(
    tensor: pb.Tensor, data: st.DataObject
) -> None:
    """Cutting an encoding anywhere gives a WireScanError or fields that all lie inside what is left."""
    raw = tensor.SerializeToString()
    cut = data.draw(st.integers(0, len(raw)))
    kept = raw[:cut]
    try:
        found = list(fields(kept))
    except WireScanError as exc:
        assert 0 <= exc.offset < cut
        return
    assert sum(len(f.data) for f in found) <= cut


@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_nothing_but_scan_errors(raw: bytes) -> None:
    """Random bytes are fields or a WireScanError: never an IndexError or a span past the buffer."""
    try:
        found = list(fields(raw))
    except WireScanError:
        return
    assert sum(len(f.data) for f in found) <= len(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x0a", "varint runs past the end"),
        (b"\x0a\x05abc", "length 5 runs past the end"),
        (b"\x0a" + b"\xff" * 9 + b"\x7f", "varint over 64 bits"),
        (b"\x08" + b"\x80" * 10 + b"\x01", "varint longer than 10 bytes"),
        (b"\x00\x01", "field number 0 out of range"),
        (b"\x0e\x01", "unknown wire type 6"),
        (b"\x0f\x01", "unknown wire type 7"),
        (b"\x0b\x0c", "groups"),
        (b"\x0c", "groups"),
        (b"\x0d\x00\x00", "fixed 4-byte value runs past the end"),
        (b"\x09\x00", "fixed 8-byte value runs past the end"),
        (b"\x12\x00" + b"\x0a\xff\xff\xff\xff\x0f", "length 4294967295 runs past the end"),
    ],
    ids=[
        "tag_without_value",
        "length_past_end",
        "varint_over_64_bits",
        "varint_over_10_bytes",
        "field_zero",
        "wire_type_6",
        "wire_type_7",
        "start_group",
        "end_group",
        "short_fixed32",
        "short_fixed64",
        "huge_length",
    ],
)
def test_malformed_encodings_are_refused_with_what_is_wrong(raw: bytes, message: str) -> None:
    """Each kind of malformed encoding is a WireScanError that says what is wrong."""
    with pytest.raises(WireScanError, match=message):
        list(fields(raw))


def test_a_refusal_names_the_offset_of_the_bad_field() -> None:
    """A length past the end after a good field is reported at the bad field's tag."""
    raw = pb.Tensor(name="x").SerializeToString() + b"\x22\x09abc"
    with pytest.raises(WireScanError) as caught:
        list(fields(raw))
    assert caught.value.offset == 3
    assert "at byte 3" in str(caught.value)


def test_a_buffer_of_another_format_is_read_as_bytes() -> None:
    """A memoryview of wider items (an array's buffer) is scanned as its bytes."""
    raw = pb.Tensor(name="ab").SerializeToString()  # 4 bytes: one uint16 pair
    wide = memoryview(np.frombuffer(raw, dtype="<u2"))
    (name,) = fields(wide)
    assert bytes(name.data) == b"ab"
