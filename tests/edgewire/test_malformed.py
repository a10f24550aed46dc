"""Malformed input is refused with its reason, before the receiver allocates for it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import zstandard as zstd
from hypothesis import given
from hypothesis import strategies as st

from edgewire import CodecLimits, DictionaryStore, FrameCodec, FrameError, pb, reject_label
from edgewire.errors import REJECT_LABELS

MIB = 1 << 20


def batch(n: int = 3, pad: int = 200) -> pb.RequestBatch:
    return pb.RequestBatch(
        requests=[pb.InferRequest(model_name="rank-mlp", tenant="t" * pad) for _ in range(n)]
    )


def envelope_of(frames: list[bytes]) -> pb.Envelope:
    return pb.Envelope.FromString(frames[0])


def with_envelope(frames: list[bytes], **changes: object) -> list[bytes]:
    env = envelope_of(frames)
    for name, value in changes.items():
        setattr(env, name, value)
    return [env.SerializeToString(), frames[1]]


def reason_of(codec: FrameCodec, frames: list[bytes]) -> str:
    with pytest.raises(FrameError) as info:
        codec.decode(frames)
    return info.value.label


def declare_content_size(frame: bytes, size: int) -> bytes:
    """Rewrite a zstd frame made without a content size so that its header claims ``size`` bytes."""
    descriptor = frame[4]
    assert descriptor >> 6 == 0 and not descriptor & 0x20, "needs a frame without FCS, with a window byte"
    return frame[:4] + bytes([descriptor | 0x80]) + frame[5:6] + size.to_bytes(4, "little") + frame[6:]


def zero_stream(total: int, level: int = 1) -> bytes:
    """A zstd frame of ``total`` zero bytes, streamed so that no content size is written."""
    cobj = zstd.ZstdCompressor(level=level, write_content_size=False).compressobj()
    chunk = bytes(MIB)
    out = [cobj.compress(chunk) for _ in range(total // MIB)]
    return b"".join([*out, cobj.flush()])


def test_wrong_frame_count() -> None:
    """One frame, or three, is not a message."""
    codec = FrameCodec()
    frames = codec.encode(batch())
    assert reason_of(codec, frames[:1]) == "wrong_frame_count"
    assert reason_of(codec, [*frames, b""]) == "wrong_frame_count"


def test_truncated_envelope() -> None:
    """An envelope cut short anywhere is refused, never half-read."""
    codec = FrameCodec()
    frames = codec.encode(batch())
    for cut in range(1, len(frames[0])):
        with pytest.raises(FrameError):
            codec.decode([frames[0][:cut], frames[1]])


def test_truncated_payload_every_length() -> None:
    """A payload cut short at any length fails as a length mismatch or a broken zstd frame."""
    codec = FrameCodec()
    frames = codec.encode(batch())
    labels = {reason_of(codec, [frames[0], frames[1][:cut]]) for cut in range(len(frames[1]))}
    assert labels <= {"length_mismatch", "decompression_failed"}


def test_truncated_uncompressed_payload() -> None:
    """An uncompressed payload shorter than declared is a length mismatch."""
    codec = FrameCodec()
    frames = codec.encode(batch(), compress=False)
    assert reason_of(codec, [frames[0], frames[1][:-1]]) == "length_mismatch"


def test_garbage_envelope() -> None:
    """Bytes that are not an Envelope are header_invalid."""
    codec = FrameCodec()
    assert reason_of(codec, [b"\xff\xff\xff\xff", b""]) == "header_invalid"


def test_wrong_schema_version() -> None:
    """A future major version is refused by name, not misread."""
    codec = FrameCodec()
    assert reason_of(codec, with_envelope(codec.encode(batch()), schema_version=2)) == "unsupported_version"
    assert reason_of(codec, with_envelope(codec.encode(batch()), schema_version=0)) == "unsupported_version"


def test_bad_message_id() -> None:
    """A message id that is not a 16-byte UUIDv7 is refused."""
    codec = FrameCodec()
    assert reason_of(codec, with_envelope(codec.encode(batch()), message_id=b"\x00" * 16)) == "bad_message_id"
    assert reason_of(codec, with_envelope(codec.encode(batch()), message_id=b"short")) == "bad_message_id"


def test_unknown_kind_and_codec() -> None:
    """Enum values this side does not know are refused."""
    codec = FrameCodec()
    assert reason_of(codec, with_envelope(codec.encode(batch()), kind=99)) == "unknown_kind"
    assert reason_of(codec, with_envelope(codec.encode(batch()), codec=42)) == "unknown_codec"
    assert reason_of(codec, with_envelope(codec.encode(batch()), codec=0)) == "unknown_codec"


def test_unknown_dictionary(trained_dictionary: bytes) -> None:
    """A frame compressed with a dictionary the receiver does not hold is refused by id."""
    sender = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary]))
    assert reason_of(FrameCodec(), sender.encode(batch())) == "unknown_dictionary"


def test_header_too_large() -> None:
    """An envelope over max_header_bytes is refused before it is parsed."""
    codec = FrameCodec(CodecLimits(max_header_bytes=64))
    frames = codec.encode(batch(), agent_id="a" * 100)
    assert reason_of(codec, frames) == "header_too_large"


def test_oversize_frame() -> None:
    """A payload frame over max_frame_bytes is refused before decompression."""
    sender = FrameCodec()
    receiver = FrameCodec(CodecLimits(max_frame_bytes=1000))
    assert reason_of(receiver, sender.encode(batch(10, 2000), compress=False)) == "frame_too_large"


def test_declared_too_large() -> None:
    """An envelope declaring more than max_decompressed_bytes is refused from the header alone."""
    codec = FrameCodec(CodecLimits(max_decompressed_bytes=MIB))
    frames = with_envelope(codec.encode(batch()), uncompressed_length=2 * MIB)
    assert reason_of(codec, frames) == "declared_too_large"


def test_too_many_records_and_count_mismatch() -> None:
    """record_count is checked against the limit first and against the payload after parsing."""
    codec = FrameCodec(CodecLimits(max_records=5))
    assert reason_of(codec, FrameCodec().encode(batch(6, 10))) == "too_many_records"
    assert reason_of(codec, with_envelope(codec.encode(batch(3)), record_count=2)) == "record_count_mismatch"


def test_invalid_protobuf_payload() -> None:
    """Bytes that are not the declared message are payload_invalid."""
    codec = FrameCodec()
    frames = with_envelope(codec.encode(batch()), codec=pb.CODEC_NONE, uncompressed_length=4)
    assert reason_of(codec, [frames[0], b"\x0a\xff\xff\xff"]) == "payload_invalid"


def test_trailing_bytes_after_zstd_frame() -> None:
    """Anything after the one zstd frame is refused, not ignored."""
    codec = FrameCodec()
    header, body = codec.encode(batch())
    assert reason_of(codec, [header, body + b"junk"]) == "decompression_failed"


def test_zstd_bomb_declaring_gigabytes_is_refused_from_header() -> None:
    """A 32 KiB frame whose content is 1 GiB is refused by the envelope or frame header, not inflated."""
    codec = FrameCodec()
    body = zero_stream(1024 * MIB)
    assert len(body) < 64 * 1024
    frames = codec.encode(batch())
    honest = with_envelope(frames, uncompressed_length=1024 * MIB)
    assert reason_of(codec, [honest[0], body]) == "declared_too_large"
    no_size = with_envelope(frames, uncompressed_length=1000)
    assert reason_of(codec, [no_size[0], body]) == "decompression_failed"
    lying = declare_content_size(body, 1000)
    assert zstd.frame_content_size(lying) == 1000
    assert reason_of(codec, [no_size[0], lying]) == "decompression_failed"


def test_zstd_bomb_memory_stays_bounded() -> None:
    """Decoding a 1 GiB bomb that lies about its size keeps the process's peak memory far below 1 GiB."""
    script = textwrap.dedent(
        """
        import resource
        from edgewire import FrameCodec, FrameError, pb
        from tests.edgewire.test_malformed import batch, declare_content_size, with_envelope, zero_stream
        codec = FrameCodec()
        bomb = declare_content_size(zero_stream(1024 << 20), 4 << 20)
        header = with_envelope(codec.encode(batch()), uncompressed_length=4 << 20)[0]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(20):
            try:
                codec.decode([header, bomb])
            except FrameError as exc:
                assert exc.label == "decompression_failed", exc
            else:
                raise SystemExit("bomb decoded")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    grown_kib = int(out.stdout.strip())
    assert grown_kib < 64 * 1024, f"peak RSS grew by {grown_kib} KiB"


def test_oversized_window_is_refused() -> None:
    """A zstd frame that asks for a window beyond max_window_bytes is refused before decoding."""
    raw = batch(50, 2000).SerializeToString()
    params = zstd.ZstdCompressionParameters.from_level(3, window_log=27, write_content_size=False)
    cobj = zstd.ZstdCompressor(compression_params=params).compressobj()
    body = declare_content_size(cobj.compress(raw) + cobj.flush(), len(raw))
    codec = FrameCodec(CodecLimits(max_window_bytes=MIB))
    frames = with_envelope(codec.encode(batch(50, 2000)), uncompressed_length=len(raw))
    assert zstd.get_frame_parameters(body).window_size > MIB
    with pytest.raises(FrameError, match="window") as info:
        codec.decode([frames[0], body])
    assert info.value.label == "decompression_failed"


@given(header=st.binary(max_size=300), body=st.binary(max_size=600))
def test_arbitrary_bytes_only_ever_raise_frame_error(header: bytes, body: bytes) -> None:
    """Whatever arrives, the codec answers a FrameError with a known label, or a valid message."""
    try:
        FrameCodec().decode([header, body])
    except FrameError as exc:
        assert exc.label in REJECT_LABELS


@given(data=st.data())
def test_mutated_valid_frames_only_ever_raise_frame_error(data: st.DataObject) -> None:
    """Bit flips and cuts in a real frame give a FrameError or a payload that parses; nothing else."""
    codec = FrameCodec()
    frames = [bytearray(f) for f in codec.encode(batch(4, 120))]
    which = data.draw(st.sampled_from([0, 1]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(frames[which]) - 1))
        frames[which][pos] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        frames[which] = frames[which][: data.draw(st.integers(0, len(frames[which])))]
    try:
        codec.decode([bytes(f) for f in frames])
    except FrameError as exc:
        assert exc.label in REJECT_LABELS


def test_every_reject_reason_has_a_label() -> None:
    """Labels are bounded and derived from the wire enum."""
    assert reject_label(pb.REJECT_REASON_FRAME_TOO_LARGE) == "frame_too_large"
    assert len(REJECT_LABELS) == len(pb.RejectReason.values()) - 1
