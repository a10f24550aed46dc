"""Redaction of captured traffic: user and session ids replaced by keyed hashes before they reach disk.

The same id always becomes the same token under one key (a replay still sees one user's requests as one
user's), and the token cannot be turned back into the id without the key. Only request batches carry
these ids; a message that cannot be decoded cannot be checked, so it is refused (the recorder drops and
counts it) rather than written in the clear. Free text in text queries is not redacted.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from edgewire import CodecLimits, DictionaryStore, FrameCodec, Serialized, pb


class Redactor:
    """Rewrites RequestBatch frames with hashed ``ranking.user_id`` / ``ranking.session_id``.

    Not thread-safe (it holds a codec): the capture writer thread owns it.
    """

    def __init__(self, key: bytes, dictionaries: DictionaryStore, limits: CodecLimits | None = None) -> None:
        if len(key) < 16:
            raise ValueError("the redaction key must be at least 16 bytes")
        self._key = key
        self._codec = FrameCodec(limits, dictionaries)

    def token(self, value: str) -> str:
        """The keyed hash that replaces an id ("" stays "")."""
        if not value:
            return ""
        return "r-" + hmac.new(self._key, value.encode(), hashlib.sha256).hexdigest()[:24]

    def redact(self, frames: Sequence[bytes]) -> tuple[bytes, ...]:
        """The message with its ids replaced; raises FrameError/ValueError when it cannot be decoded."""
        envelope = self._codec.decode_envelope(frames)
        if envelope.kind != pb.MESSAGE_KIND_REQUEST_BATCH:
            return tuple(frames)
        batch = self._codec.decode_payload(envelope, frames[1])
        assert isinstance(batch, pb.RequestBatch)
        for request in batch.requests:
            if request.HasField("ranking"):
                request.ranking.user_id = self.token(request.ranking.user_id)
                request.ranking.session_id = self.token(request.ranking.session_id)
        raw = batch.SerializeToString()
        compressed = envelope.codec == pb.CODEC_ZSTD
        new_envelope, body = self._codec.encode(
            Serialized(envelope.kind, raw, len(batch.requests)), dict_id=envelope.dict_id, compress=compressed
        )
        fresh = pb.Envelope()
        fresh.ParseFromString(new_envelope)
        envelope.codec = fresh.codec
        envelope.dict_id = fresh.dict_id
        envelope.uncompressed_length = fresh.uncompressed_length
        return envelope.SerializeToString(), body
