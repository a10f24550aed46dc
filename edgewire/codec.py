"""The frame codec: ``[envelope, payload]`` multipart messages, zstd-compressed, checked before allocation.

Receivers call :meth:`FrameCodec.decode` (or the two halves, :meth:`FrameCodec.decode_envelope` to shed on the
header alone, then :meth:`FrameCodec.decode_payload`). Every refusal is a :class:`FrameError` whose reason is
the wire's ``RejectReason``. Senders call :meth:`FrameCodec.encode`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, cast

import zstandard as zstd
from google.protobuf.message import DecodeError, Message

from edgewire.dictionaries import DictionaryStore
from edgewire.errors import FrameError
from edgewire.ids import is_valid_id, new_id
from edgewire.limits import CodecLimits
from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb

SCHEMA_VERSION: Final = 1
DEFAULT_LEVEL: Final = 3
# Below this size zstd's frame overhead outweighs any gain; such payloads travel as CODEC_NONE.
DEFAULT_COMPRESS_MIN_BYTES: Final = 96
DEFAULT_MIN_SAVING: Final = 0.1
"""A compressed body that saves less than this share of the payload is not sent: the payload goes raw
(CODEC_NONE). Dense tensors and JPEG bytes shrink by 4-8% at zstd level 3, and the receiver would spend a
core per ~1.4 GB/s decompressing them (the gateway's event loop, for every agent)."""
PROBE_MIN_BYTES: Final = 256 << 10
"""Payloads at least this large are tried on a sample first (eight 6 KiB slices spread over the payload),
so the sender does not compress megabytes of tensors to find they do not shrink; slices from all over the
payload keep a batch that mixes JPEG bytes and features from being judged by its JPEG bytes alone."""
_PROBE_SLICES: Final = 8
ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
"""The first four bytes of a zstd frame (RFC 8878); a skippable frame (``5? 2a 4d 18``) is not one."""
_PROBE_SLICE: Final = 6 << 10

Buffer = bytes | bytearray | memoryview

PAYLOAD_TYPES: Final[dict[pb.MessageKind.ValueType, type[Message]]] = {
    pb.MESSAGE_KIND_REQUEST_BATCH: pb.RequestBatch,
    pb.MESSAGE_KIND_RESPONSE_BATCH: pb.ResponseBatch,
    pb.MESSAGE_KIND_ACK: pb.Ack,
    pb.MESSAGE_KIND_PING: pb.Ping,
    pb.MESSAGE_KIND_PONG: pb.Pong,
    pb.MESSAGE_KIND_DICTIONARY_REQUEST: pb.DictionaryRequest,
    pb.MESSAGE_KIND_DICTIONARY_RESPONSE: pb.DictionaryResponse,
}
_KIND_OF_TYPE: Final = {cls: kind for kind, cls in PAYLOAD_TYPES.items()}


def now_unix_us() -> int:
    return time.time_ns() // 1000


def record_count_of(payload: Message) -> int:
    """Records carried by a payload: requests or responses in a batch, 0 for control messages."""
    if isinstance(payload, pb.RequestBatch):
        return len(payload.requests)
    if isinstance(payload, pb.ResponseBatch):
        return len(payload.responses)
    return 0


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SHORT_LENGTHS: Final = tuple(_varint(n) for n in range(1 << 14))
"""The varints of lengths up to two bytes (16 KiB): a response's length prefix is looked up, not built."""


def repeated_field(field_number: int, items: Sequence[bytes]) -> bytes:
    """Serialized messages as the repeated message field ``field_number`` of an enclosing message.

    Protobuf's wire format makes this a plain concatenation (tag, length, bytes per item), so a batch of
    already serialized responses becomes a ResponseBatch without parsing any of them again.
    """
    tag = _varint(field_number << 3 | 2)
    short = _SHORT_LENGTHS
    parts: list[bytes] = []
    append = parts.append
    for item in items:
        n = len(item)
        append(tag)
        append(short[n] if n < len(short) else _varint(n))
        append(item)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Serialized:
    """A payload already serialized (e.g. with :func:`repeated_field`), for :meth:`FrameCodec.encode`."""

    kind: pb.MessageKind.ValueType
    raw: bytes
    record_count: int


@dataclass(frozen=True, slots=True)
class Decoded:
    """A frame that passed every check: its envelope and its parsed payload."""

    envelope: pb.Envelope
    payload: Message


class FrameCodec:
    """Encodes and decodes wire frames. Not thread-safe: keep one per thread or event loop."""

    def __init__(
        self,
        limits: CodecLimits | None = None,
        dictionaries: DictionaryStore | None = None,
        *,
        level: int = DEFAULT_LEVEL,
        compress_min_bytes: int = DEFAULT_COMPRESS_MIN_BYTES,
        min_saving: float = DEFAULT_MIN_SAVING,
    ) -> None:
        if not 1 <= level <= 22:
            raise ValueError("zstd level must be in [1, 22]")
        if not 0.0 <= min_saving < 1.0:
            raise ValueError("min_saving must be in [0, 1)")
        self.limits = limits or CodecLimits()
        self.dictionaries = dictionaries or DictionaryStore()
        self.level = level
        self.compress_min_bytes = compress_min_bytes
        self.min_saving = min_saving
        self.sent_raw = 0  # payloads sent uncompressed because zstd would not have saved min_saving
        self._compressors: dict[int, zstd.ZstdCompressor] = {}
        self._decompressors: dict[int, zstd.ZstdDecompressor] = {}

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        payload: Message | Serialized,
        *,
        agent_id: str = "",
        region: str = "",
        priority: pb.PriorityClass.ValueType = pb.PRIORITY_CLASS_INTERACTIVE,
        deadline_unix_us: int = 0,
        message_id: bytes | None = None,
        dict_id: int | None = None,
        compress: bool = True,
        attempt: int = 0,
        sent_at_unix_us: int | None = None,
        frame_limit: int = 0,
        features: int = 0,
    ) -> list[bytes]:
        """Serialize (unless it is :class:`Serialized` already), compress and frame one payload.

        ``dict_id=None`` uses the preferred dictionary; ``frame_limit``: the receiver's largest frame, when
        known (else this codec's ``max_frame_bytes``); ``features``: what the sender can read
        (``Envelope.features``, a sum of ``pb.Feature`` values).
        """
        if isinstance(payload, Serialized):
            kind, raw, record_count = payload.kind, payload.raw, payload.record_count
        else:
            found = _KIND_OF_TYPE.get(type(payload))
            if found is None:
                raise TypeError(f"{type(payload).__name__} is not a wire payload")
            kind, raw, record_count = found, payload.SerializeToString(), record_count_of(payload)
        if len(raw) > self.limits.max_decompressed_bytes:
            raise ValueError(f"payload of {len(raw)} bytes is over max_decompressed_bytes")
        envelope = pb.Envelope(
            schema_version=SCHEMA_VERSION,
            message_id=message_id or new_id(),
            agent_id=agent_id,
            region=region,
            kind=kind,
            priority=priority,
            deadline_unix_us=deadline_unix_us,
            sent_at_unix_us=now_unix_us() if sent_at_unix_us is None else sent_at_unix_us,
            uncompressed_length=len(raw),
            record_count=record_count,
            attempt=attempt,
            features=features,
        )
        body = raw
        envelope.codec = pb.CODEC_NONE
        if compress and len(raw) >= self.compress_min_bytes:
            used = self.dictionaries.preferred if dict_id is None else dict_id
            packed = self._compressed(self._compressor(used), raw, frame_limit or self.limits.max_frame_bytes)
            if packed is not None:
                body = packed
                envelope.codec = pb.CODEC_ZSTD
                envelope.dict_id = used
            else:
                self.sent_raw += 1
        return [envelope.SerializeToString(), body]

    def _compressed(self, compressor: zstd.ZstdCompressor, raw: bytes, frame_limit: int) -> bytes | None:
        """``raw`` compressed, or None when that saves less than ``min_saving`` of it (a large payload is
        judged on a sample first). A payload over ``frame_limit`` is compressed whenever that makes it
        smaller: raw, it could not be sent at all."""
        oversize = len(raw) > frame_limit
        keep = 1.0 if oversize else 1.0 - self.min_saving
        if len(raw) >= PROBE_MIN_BYTES and not oversize:
            step = len(raw) // _PROBE_SLICES
            sample = b"".join(raw[i * step : i * step + _PROBE_SLICE] for i in range(_PROBE_SLICES))
            if len(compressor.compress(sample)) > len(sample) * keep:
                return None
        packed = compressor.compress(raw)
        if len(packed) > len(raw) * keep or len(packed) >= len(raw):
            return None
        # python-zstandard (0.25) returns bytes holding zstd's worst-case output size: a frame kept for a
        # resend would cost ~4x its length. One copy makes it cost its length.
        return bytes(memoryview(packed))

    def reframe(self, envelope: pb.Envelope, body: bytes, **changes: int | str | bytes) -> list[bytes]:
        """Re-send an already encoded payload under a copy of its envelope with some fields changed."""
        fresh = pb.Envelope()
        fresh.CopyFrom(envelope)
        for name, value in changes.items():
            setattr(fresh, name, value)
        return [fresh.SerializeToString(), body]

    def _compressor(self, dict_id: int) -> zstd.ZstdCompressor:
        compressor = self._compressors.get(dict_id)
        if compressor is None:
            dictionary = self.dictionaries.get(dict_id) if dict_id else None
            if dict_id and dictionary is None:
                raise KeyError(f"dictionary {dict_id} is not held")
            compressor = zstd.ZstdCompressor(
                level=self.level, dict_data=dictionary, write_content_size=True, write_dict_id=False
            )
            self._compressors[dict_id] = compressor
        return compressor

    # ------------------------------------------------------------------ decode

    def decode(self, frames: Sequence[Buffer]) -> Decoded:
        """Check and parse a received multipart message; raises FrameError with the first rule it breaks."""
        envelope = self.decode_envelope(frames)
        return Decoded(envelope, self.decode_payload(envelope, frames[1]))

    def decode_envelope(self, frames: Sequence[Buffer]) -> pb.Envelope:
        """Parse and check frame 0 and the sizes it declares, without touching the payload's content."""
        limits = self.limits
        if len(frames) != 2:
            raise FrameError(pb.REJECT_REASON_WRONG_FRAME_COUNT, f"{len(frames)} frames, expected 2")
        header, body = frames
        if len(header) > limits.max_header_bytes:
            raise FrameError(pb.REJECT_REASON_HEADER_TOO_LARGE, f"{len(header)} > {limits.max_header_bytes}")
        try:
            # upb parses any buffer without a copy; the stubs only admit bytes.
            envelope = pb.Envelope.FromString(cast(bytes, header))
        except DecodeError as exc:
            raise FrameError(pb.REJECT_REASON_HEADER_INVALID, str(exc) or "unparseable envelope") from exc
        if envelope.schema_version != SCHEMA_VERSION:
            raise FrameError(
                pb.REJECT_REASON_UNSUPPORTED_VERSION,
                f"schema_version {envelope.schema_version}, this side speaks {SCHEMA_VERSION}",
            )
        if not is_valid_id(envelope.message_id):
            raise FrameError(pb.REJECT_REASON_BAD_MESSAGE_ID, "message_id is not a 16-byte UUIDv7")
        if envelope.kind not in PAYLOAD_TYPES:
            raise FrameError(pb.REJECT_REASON_UNKNOWN_KIND, f"kind {envelope.kind}")
        if envelope.codec not in (pb.CODEC_NONE, pb.CODEC_ZSTD):
            raise FrameError(pb.REJECT_REASON_UNKNOWN_CODEC, f"codec {envelope.codec}")
        if len(body) > limits.max_frame_bytes:
            raise FrameError(pb.REJECT_REASON_FRAME_TOO_LARGE, f"{len(body)} > {limits.max_frame_bytes}")
        if envelope.uncompressed_length > limits.max_decompressed_bytes:
            raise FrameError(
                pb.REJECT_REASON_DECLARED_TOO_LARGE,
                f"declares {envelope.uncompressed_length} > {limits.max_decompressed_bytes}",
            )
        if envelope.record_count > limits.max_records:
            raise FrameError(
                pb.REJECT_REASON_TOO_MANY_RECORDS, f"{envelope.record_count} > {limits.max_records}"
            )
        if envelope.codec == pb.CODEC_ZSTD and envelope.dict_id and envelope.dict_id not in self.dictionaries:
            raise FrameError(pb.REJECT_REASON_UNKNOWN_DICTIONARY, f"dict_id {envelope.dict_id}")
        return envelope

    def decode_payload(self, envelope: pb.Envelope, body: Buffer) -> Message:
        """Decompress (bounded by the declared length) and parse frame 1 of a checked envelope."""
        return self.decode_payload_bytes(envelope, body)[0]

    def decode_payload_bytes(self, envelope: pb.Envelope, body: Buffer) -> tuple[Message, Buffer]:
        """:meth:`decode_payload`, and the bytes it parsed (decompressed, or ``body`` itself)."""
        raw = self.inflate(envelope, body)
        return self.parse_payload(envelope, raw), raw

    def inflate(
        self,
        envelope: pb.Envelope,
        body: Buffer,
        decompressors: dict[int, zstd.ZstdDecompressor] | None = None,
    ) -> Buffer:
        """Frame 1 of a checked envelope as the bytes its payload is parsed from: decompressed (bounded by
        the declared length) or, raw, ``body`` itself once its length agrees.

        ``decompressors``: a cache of this caller's own, for a thread other than the codec's (a
        ZstdDecompressor is not to be shared between threads; libzstd releases the GIL while it works)."""
        if envelope.codec == pb.CODEC_ZSTD:
            return self._decompress(envelope, body, decompressors)
        declared = envelope.uncompressed_length
        if len(body) != declared:
            raise FrameError(pb.REJECT_REASON_LENGTH_MISMATCH, f"{len(body)} bytes, declared {declared}")
        return body

    def parse_payload(self, envelope: pb.Envelope, raw: Buffer) -> Message:
        """The payload message of a checked envelope from its inflated bytes (:meth:`inflate`)."""
        cls = PAYLOAD_TYPES[envelope.kind]
        try:
            payload = cls.FromString(cast(bytes, raw))
        except DecodeError as exc:
            raise FrameError(pb.REJECT_REASON_PAYLOAD_INVALID, str(exc) or cls.__name__) from exc
        count = record_count_of(payload)
        if count != envelope.record_count:
            raise FrameError(
                pb.REJECT_REASON_RECORD_COUNT_MISMATCH, f"{count} records, declared {envelope.record_count}"
            )
        return payload

    def _decompress(
        self,
        envelope: pb.Envelope,
        body: Buffer,
        decompressors: dict[int, zstd.ZstdDecompressor] | None = None,
    ) -> bytes:
        declared = envelope.uncompressed_length
        # libzstd reads a skippable frame's content size as 0: without this check such a payload would be
        # refused as a length mismatch, which names the wrong fault.
        if bytes(body[:4]) != ZSTD_MAGIC:
            raise FrameError(
                pb.REJECT_REASON_DECOMPRESSION_FAILED, "frame 1 does not start with a zstd frame"
            )
        try:
            content_size = zstd.frame_content_size(body)
            window = zstd.get_frame_parameters(body).window_size
        except zstd.ZstdError as exc:
            raise FrameError(pb.REJECT_REASON_DECOMPRESSION_FAILED, f"bad zstd frame header: {exc}") from exc
        # The frame's own content size is what libzstd allocates for; it must be present and agree with
        # the envelope, which was already checked against max_decompressed_bytes.
        if content_size == -1:
            raise FrameError(pb.REJECT_REASON_DECOMPRESSION_FAILED, "zstd frame lacks its content size")
        if content_size != declared:
            raise FrameError(
                pb.REJECT_REASON_LENGTH_MISMATCH, f"zstd frame holds {content_size}, declared {declared}"
            )
        if window > self.limits.max_window_bytes:
            raise FrameError(
                pb.REJECT_REASON_DECOMPRESSION_FAILED,
                f"zstd window {window} over {self.limits.max_window_bytes}",
            )
        try:
            decompressor = self._decompressor(envelope.dict_id, decompressors)
            raw = decompressor.decompress(body, allow_extra_data=False)
        except zstd.ZstdError as exc:
            raise FrameError(pb.REJECT_REASON_DECOMPRESSION_FAILED, str(exc)) from exc
        if len(raw) != declared:
            raise FrameError(
                pb.REJECT_REASON_LENGTH_MISMATCH, f"decompressed {len(raw)}, declared {declared}"
            )
        return bytes(raw)

    def _decompressor(
        self, dict_id: int, cache: dict[int, zstd.ZstdDecompressor] | None = None
    ) -> zstd.ZstdDecompressor:
        cache = self._decompressors if cache is None else cache
        decompressor = cache.get(dict_id)
        if decompressor is None:
            dictionary = self.dictionaries.get(dict_id) if dict_id else None
            if dict_id and dictionary is None:
                raise FrameError(pb.REJECT_REASON_UNKNOWN_DICTIONARY, f"dict_id {dict_id}")
            decompressor = zstd.ZstdDecompressor(
                dict_data=dictionary, max_window_size=self.limits.max_window_bytes
            )
            cache[dict_id] = decompressor
        return decompressor
