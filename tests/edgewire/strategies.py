"""Hypothesis strategies for every wire message kind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hypothesis import strategies as st

from edgewire import pb
from edgewire.ids import id_from_parts

ids = st.builds(id_from_parts, st.integers(0, (1 << 48) - 1), st.integers(0, (1 << 74) - 1))
text = st.text(max_size=40)
small_bytes = st.binary(max_size=256)
u32 = st.integers(0, (1 << 32) - 1)
i64 = st.integers(-(1 << 63), (1 << 63) - 1)
f32 = st.floats(width=32, allow_nan=False)


class ProtoEnum(Protocol):
    """A generated protobuf enum (its EnumTypeWrapper)."""

    def values(self) -> Sequence[int]: ...


def enum_values(enum: ProtoEnum) -> st.SearchStrategy[int]:
    return st.sampled_from(list(enum.values()))


tensors = st.builds(
    pb.Tensor,
    name=text,
    datatype=enum_values(pb.DataType),
    shape=st.lists(st.integers(0, 1 << 20), max_size=4),
    raw_data=small_bytes,
)
ranking = st.builds(
    pb.RankingFeatures,
    user_id=text,
    session_id=text,
    candidate_item_ids=st.lists(st.integers(0, (1 << 64) - 1), max_size=50),
    candidate_dense=st.lists(f32, max_size=100),
    candidate_feature_width=st.integers(0, 64),
    user_dense=st.lists(f32, max_size=16),
    categorical_tags=st.lists(text, max_size=6),
    top_k=st.integers(0, 500),
)
requests = st.builds(
    pb.InferRequest,
    request_id=ids,
    model_name=text,
    model_version=text,
    kind=enum_values(pb.RequestKind),
    priority=enum_values(pb.PriorityClass),
    deadline_unix_us=i64,
    complexity_hint=st.floats(0, 1, width=32),
    inputs=st.lists(tensors, max_size=3),
    ranking=ranking,
    text=st.builds(pb.TextQuery, text=st.text(max_size=200), locale=text),
    image=st.builds(
        pb.ImageInput, data=small_bytes, format=enum_values(pb.ImageFormat), width=u32, height=u32
    ),
    parameters=st.dictionaries(text, text, max_size=3),
    tenant=text,
)
responses = st.builds(
    pb.InferResponse,
    request_id=ids,
    status=enum_values(pb.Status),
    error_message=text,
    outputs=st.lists(tensors, max_size=3),
    tier=enum_values(pb.Tier),
    pool=text,
    model_name=text,
    model_version=text,
    timing=st.builds(
        pb.ServerTiming, queue_us=u32, preprocess_us=u32, infer_us=u32, postprocess_us=u32, total_us=u32
    ),
    retry_after_ms=u32,
    route_reason=text,
)
nacks = st.builds(pb.Nack, request_id=ids, reason=enum_values(pb.NackReason), retry_after_ms=u32, detail=text)

PAYLOADS: dict[str, st.SearchStrategy[object]] = {
    "request_batch": st.builds(pb.RequestBatch, requests=st.lists(requests, max_size=8)),
    "response_batch": st.builds(pb.ResponseBatch, responses=st.lists(responses, max_size=8)),
    "ack": st.builds(
        pb.Ack,
        acked_message_id=ids,
        accepted_ids=st.lists(ids, max_size=8),
        duplicate_ids=st.lists(ids, max_size=4),
        nacks=st.lists(nacks, max_size=4),
        frame_reject=enum_values(pb.RejectReason),
        frame_reject_detail=text,
    ),
    "ping": st.builds(pb.Ping, nonce=st.integers(0, (1 << 64) - 1), dict_ids=st.lists(u32, max_size=4)),
    "pong": st.builds(
        pb.Pong,
        nonce=st.integers(0, (1 << 64) - 1),
        ping_sent_at_unix_us=i64,
        server_time_unix_us=i64,
        dict_ids=st.lists(u32, max_size=4),
        preferred_dict_id=u32,
        limits=st.builds(pb.Limits, max_frame_bytes=u32, max_decompressed_bytes=u32, max_records=u32),
        draining=st.booleans(),
    ),
    "dictionary_request": st.builds(pb.DictionaryRequest, dict_id=u32),
    "dictionary_response": st.builds(pb.DictionaryResponse, dict_id=u32, dictionary=st.binary(max_size=2048)),
}
