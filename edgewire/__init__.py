"""Wire codec shared by the edge agent and the Hong Kong gateway: schema, frames, limits, dictionaries."""

from edgewire.codec import (
    SCHEMA_VERSION,
    Decoded,
    FrameCodec,
    Serialized,
    now_unix_us,
    record_count_of,
    repeated_field,
)
from edgewire.dictionaries import DictionaryError, DictionaryStore
from edgewire.errors import REJECT_LABELS, FrameError, reject_label
from edgewire.ids import id_unix_ms, is_valid_id, new_id
from edgewire.limits import CodecLimits
from edgewire.pb.edgeinfer.v1 import wire_pb2 as pb

__all__ = [
    "REJECT_LABELS",
    "SCHEMA_VERSION",
    "CodecLimits",
    "Decoded",
    "DictionaryError",
    "DictionaryStore",
    "FrameCodec",
    "FrameError",
    "Serialized",
    "id_unix_ms",
    "is_valid_id",
    "new_id",
    "now_unix_us",
    "pb",
    "record_count_of",
    "reject_label",
    "repeated_field",
]
