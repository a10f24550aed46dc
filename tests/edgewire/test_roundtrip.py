"""Every message kind survives encode -> decode through the codec unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard as zstd
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from edgewire import (
    SCHEMA_VERSION,
    DictionaryStore,
    FrameCodec,
    Serialized,
    is_valid_id,
    pb,
    record_count_of,
)
from edgewire.limits import CodecLimits
from tests.edgewire.strategies import PAYLOADS


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@given(data=st.data())
def test_every_kind_round_trips(kind: str, data: st.DataObject) -> None:
    """A payload of each kind decodes to an equal message with its envelope intact, compressed or not."""
    payload = data.draw(PAYLOADS[kind])
    assert isinstance(payload, Message)
    compress = data.draw(st.booleans())
    codec = FrameCodec()
    frames = codec.encode(
        payload,
        agent_id="edge-us-west-1",
        region="us-west",
        priority=pb.PRIORITY_CLASS_REALTIME,
        deadline_unix_us=1_795_000_000_123_456,
        compress=compress,
        attempt=2,
    )
    decoded = codec.decode(frames)
    assert decoded.payload == payload
    env = decoded.envelope
    assert env.schema_version == SCHEMA_VERSION
    assert is_valid_id(env.message_id)
    assert (env.agent_id, env.region, env.attempt) == ("edge-us-west-1", "us-west", 2)
    assert env.priority == pb.PRIORITY_CLASS_REALTIME
    assert env.deadline_unix_us == 1_795_000_000_123_456
    assert env.record_count == record_count_of(payload)
    assert env.uncompressed_length == payload.ByteSize()


@given(batch=PAYLOADS["request_batch"])
def test_request_batch_round_trips_with_dictionary(trained_dictionary: bytes, batch: pb.RequestBatch) -> None:
    """With a trained dictionary the envelope names it and the receiver holding it decodes the batch."""
    sender = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary]), compress_min_bytes=0)
    receiver = FrameCodec(dictionaries=DictionaryStore.from_raw([trained_dictionary]))
    frames = sender.encode(batch)
    envelope = receiver.decode_envelope(frames)
    if envelope.codec == pb.CODEC_ZSTD:
        assert envelope.dict_id == sender.dictionaries.preferred != 0
    else:  # random strings that zstd did not shrink by min_saving travel raw
        assert (envelope.codec, envelope.dict_id, sender.sent_raw) == (pb.CODEC_NONE, 0, 1)
    assert receiver.decode(frames).payload == batch


def _tensor_batch(array: np.ndarray) -> pb.RequestBatch:
    tensor = pb.Tensor(name="pixels", datatype=pb.DATA_TYPE_FP16, shape=array.shape, raw_data=array.tobytes())
    return pb.RequestBatch(requests=[pb.InferRequest(model_name="vision", inputs=[tensor])])


class _CountingCompressor:
    """A zstd compressor that records the length of everything it is asked to compress."""

    def __init__(self) -> None:
        self.inner = zstd.ZstdCompressor(level=3)
        self.lengths: list[int] = []

    def compress(self, data: bytes) -> bytes:
        self.lengths.append(len(data))
        return self.inner.compress(data)


def test_payloads_zstd_does_not_shrink_travel_raw_and_large_ones_are_judged_on_a_sample() -> None:
    """Random fp16 pixels (zstd saves ~8%) go uncompressed, decided on a 48 KiB sample without compressing
    the megabyte; a compressible one of the same size is compressed whole; both decode."""
    codec = FrameCodec()
    counting = _CountingCompressor()
    codec._compressors[0] = counting  # type: ignore[assignment]  # the codec's cache of compressors
    noise = _tensor_batch(np.random.default_rng(3).standard_normal((1, 3, 400, 400)).astype(np.float16))
    frames = codec.encode(noise)
    envelope = codec.decode_envelope(frames)
    assert (envelope.codec, codec.sent_raw) == (pb.CODEC_NONE, 1)
    assert counting.lengths == [48 << 10]  # the sample only
    assert codec.decode(frames).payload == noise
    flat = _tensor_batch(np.zeros((1, 3, 400, 400), dtype=np.float16))
    frames = codec.encode(flat)
    assert codec.decode_envelope(frames).codec == pb.CODEC_ZSTD
    assert counting.lengths[1:] == [48 << 10, flat.ByteSize()]
    assert codec.decode(frames).payload == flat


def test_a_payload_zstd_would_grow_travels_raw_even_without_a_min_saving() -> None:
    """``min_saving = 0`` compresses whatever does not grow; a short random string grows (frame header)."""
    codec = FrameCodec(compress_min_bytes=0, min_saving=0.0)
    batch = pb.RequestBatch(requests=[pb.InferRequest(request_id=np.random.default_rng(1).bytes(40))])
    frames = codec.encode(batch)
    assert codec.decode_envelope(frames).codec == pb.CODEC_NONE and codec.sent_raw == 1
    repetitive = pb.RequestBatch(requests=[pb.InferRequest(model_name="rank-mlp" * 40)])
    assert codec.decode_envelope(codec.encode(repetitive)).codec == pb.CODEC_ZSTD
    with pytest.raises(ValueError, match="min_saving"):
        FrameCodec(min_saving=1.0)


def test_memoryview_frames_decode_without_copy_requirements() -> None:
    """Frames handed over as memoryviews (pyzmq copy=False) decode like bytes."""
    codec = FrameCodec()
    batch = pb.RequestBatch(requests=[pb.InferRequest(model_name="rank-mlp", tenant="x" * 300)])
    frames = codec.encode(batch)
    assert codec.decode([memoryview(f) for f in frames]).payload == batch


def test_small_control_messages_skip_compression() -> None:
    """Payloads below compress_min_bytes travel as CODEC_NONE; zstd would only add its frame header."""
    codec = FrameCodec()
    header, body = codec.encode(pb.Ping(nonce=7))
    assert pb.Envelope.FromString(header).codec == pb.CODEC_NONE
    assert body == pb.Ping(nonce=7).SerializeToString()


def test_reframe_changes_only_the_named_fields() -> None:
    """A resend keeps the payload bytes and message id and bumps the attempt."""
    codec = FrameCodec()
    frames = codec.encode(pb.RequestBatch(requests=[pb.InferRequest(model_name="m")]))
    envelope = codec.decode_envelope(frames)
    header, body = codec.reframe(envelope, frames[1], attempt=1)
    again = codec.decode([header, body])
    assert again.envelope.attempt == 1
    assert again.envelope.message_id == envelope.message_id
    assert body == frames[1]


def test_encode_refuses_non_wire_messages() -> None:
    """Only the payload types of the schema can be framed."""
    with pytest.raises(TypeError):
        FrameCodec().encode(pb.Tensor())


def test_repeated_field_length_prefixes_across_the_table_s_end() -> None:
    """Items of 0, 127, 128, 16,383, 16,384 and 300,000 bytes parse back: short and long length prefixes."""
    from edgewire import repeated_field

    sizes = (0, 127, 128, 16_383, 16_384, 300_000)
    batch = pb.RequestBatch(
        requests=[pb.InferRequest(request_id=b"i" * 16, model_name="m" * max(0, n - 20)) for n in sizes]
    )
    items = [r.SerializeToString() for r in batch.requests]
    assert pb.RequestBatch.FromString(repeated_field(1, items)) == batch


@given(batch=PAYLOADS["response_batch"])
def test_repeated_field_assembles_a_batch_from_serialized_items(batch: pb.ResponseBatch) -> None:
    """Concatenating serialized responses with repeated_field equals serializing the batch."""
    from edgewire import repeated_field

    raw = repeated_field(1, [r.SerializeToString() for r in batch.responses])
    assert pb.ResponseBatch.FromString(raw) == batch
    codec = FrameCodec()
    frames = codec.encode(Serialized(pb.MESSAGE_KIND_RESPONSE_BATCH, raw, len(batch.responses)))
    assert codec.decode(frames).payload == batch


def test_a_kept_compressed_frame_costs_about_its_length() -> None:
    """python-zstandard returns bytes sized for zstd's worst case; the codec hands back a right-sized copy,
    so frames an agent keeps for resends (or a benchmark builds ahead) cost their length, not ~4x it."""
    import os
    import tracemalloc

    codec = FrameCodec()
    payload = os.urandom(4000) + b"ranking features " * 4000  # compresses to ~4 kB of 72 kB
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        bodies = [codec.encode(Serialized(pb.MESSAGE_KIND_REQUEST_BATCH, payload, 1))[1] for _ in range(50)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    length = sum(len(b) for b in bodies)
    assert length < len(payload) * 50 / 5  # it did compress
    assert held < 1.5 * length + 50 * 1024, (held, length)


def test_a_payload_too_large_to_send_raw_is_compressed_whenever_that_makes_it_smaller() -> None:
    """Over max_frame_bytes the raw payload could not be sent at all: an 8% saving is kept."""
    noise = _tensor_batch(np.random.default_rng(4).standard_normal((1, 3, 300, 300)).astype(np.float16))
    assert noise.ByteSize() > 500_000
    roomy, tight = FrameCodec(), FrameCodec(CodecLimits(max_frame_bytes=500_000))
    assert roomy.decode_envelope(roomy.encode(noise)).codec == pb.CODEC_NONE
    frames = tight.encode(noise)
    assert tight.decode_envelope(frames).codec == pb.CODEC_ZSTD and tight.sent_raw == 0
    assert len(frames[1]) < noise.ByteSize()


def test_the_receivers_frame_limit_decides_what_is_too_large_to_send_raw() -> None:
    """The receiver's frame limit (the agent learns the gateway's from its Pong) counts, not the codec's."""
    noise = _tensor_batch(np.random.default_rng(5).standard_normal((1, 3, 300, 300)).astype(np.float16))
    codec = FrameCodec()  # its own limit (8 MiB) holds the payload raw
    assert codec.decode_envelope(codec.encode(noise)).codec == pb.CODEC_NONE
    frames = codec.encode(noise, frame_limit=500_000)
    assert codec.decode_envelope(frames).codec == pb.CODEC_ZSTD and len(frames[1]) < noise.ByteSize()
