"""From a wire request to the values routing decides on (no protobuf inside ``routing/``)."""

from __future__ import annotations

from edgewire import pb
from inference.pipeline.textsize import estimated_tokens
from routing.types import Priority, RequestKind, RequestProfile

PRIORITY_OF_WIRE: dict[int, Priority] = {
    # the routing priority of each wire class (wire_priority's table, for loops that look it up themselves)
    pb.PRIORITY_CLASS_UNSPECIFIED: Priority.INTERACTIVE,
    pb.PRIORITY_CLASS_REALTIME: Priority.REALTIME,
    pb.PRIORITY_CLASS_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_CLASS_BATCH: Priority.BATCH,
}
_KIND = {
    pb.REQUEST_KIND_RANKING: RequestKind.RANKING,
    pb.REQUEST_KIND_TEXT: RequestKind.TEXT,
    pb.REQUEST_KIND_IMAGE: RequestKind.IMAGE,
    pb.REQUEST_KIND_TENSOR: RequestKind.TENSOR,
}


def wire_priority(value: int) -> Priority:
    """The routing priority of a wire class; unknown and UNSPECIFIED values are INTERACTIVE."""
    return PRIORITY_OF_WIRE.get(value, Priority.INTERACTIVE)


def request_kind(request: pb.InferRequest) -> RequestKind:
    """The kind a request declares, or the one its populated fields imply."""
    kind = _KIND.get(request.kind)
    if kind is not None:
        return kind
    if request.HasField("ranking"):
        return RequestKind.RANKING
    if request.HasField("text"):
        return RequestKind.TEXT
    if request.HasField("image"):
        return RequestKind.IMAGE
    return RequestKind.TENSOR


Sizes = tuple[RequestKind, int, int, int, int, int, int]
"""A request's kind and size fields as :class:`RequestProfile` holds them: (kind, candidates, feature
width, text chars, text tokens, pixels, tensor elements)."""


def sizes_of(request: pb.InferRequest) -> Sizes:
    """What :func:`profile_of` reads from a request, without building the profile (the frame path reads it
    for every request and builds profiles per group)."""
    kind = _KIND.get(request.kind) or request_kind(request)
    if kind is RequestKind.RANKING:
        ranking = request.ranking
        width = ranking.candidate_feature_width + len(ranking.user_dense)
        return kind, len(ranking.candidate_item_ids), width, 0, 0, 0, 0
    if kind is RequestKind.TEXT:
        text = request.text.text
        return kind, 0, 0, len(text), estimated_tokens(text), 0, 0
    if kind is RequestKind.IMAGE:
        return kind, 0, 0, 0, 0, request.image.width * request.image.height, 0
    elements = 0
    for tensor in request.inputs:
        count = 1
        for dim in tensor.shape:
            count *= max(int(dim), 0)
        elements += count
    return kind, 0, 0, 0, 0, 0, elements


def profile_from(
    request: pb.InferRequest,
    sizes: Sizes,
    priority: Priority,
    remaining_s: float | None,
    region: str,
    hint: float | None = None,
) -> RequestProfile:
    """The profile of ``request`` from its :func:`sizes_of` (equal to :func:`profile_of`'s); ``hint``:
    another client hint in its place (a group's bound)."""
    kind, candidates, width, chars, tokens, pixels, elements = sizes
    return RequestProfile(
        kind,
        request.model_name,
        request.model_version,
        priority,
        remaining_s,
        candidates,
        width,
        chars,
        tokens,
        pixels,
        elements,
        min(max(request.complexity_hint, 0.0), 1.0) if hint is None else hint,
        region,
    )


def profile_of(
    request: pb.InferRequest,
    priority: Priority,
    remaining_s: float | None,
    region: str,
    text_tokens: int | None = None,
) -> RequestProfile:
    """What routing needs, read from the request alone (sizes, never contents). ``text_tokens``: the
    estimate made earlier for this request (a reroute), instead of counting again."""
    kind = request_kind(request)
    candidates = width = chars = tokens = pixels = elements = 0
    if kind is RequestKind.RANKING:
        ranking = request.ranking
        candidates = len(ranking.candidate_item_ids)
        width = ranking.candidate_feature_width + len(ranking.user_dense)
    elif kind is RequestKind.TEXT:
        text = request.text.text
        chars = len(text)
        # not chars / 4: CJK text has about one token per character
        tokens = estimated_tokens(text) if text_tokens is None else text_tokens
    elif kind is RequestKind.IMAGE:
        pixels = request.image.width * request.image.height
    else:
        for tensor in request.inputs:
            count = 1
            for dim in tensor.shape:
                count *= max(int(dim), 0)
            elements += count
    return RequestProfile(
        kind=kind,
        model=request.model_name,
        model_version=request.model_version,
        priority=priority,
        remaining_deadline_s=remaining_s,
        candidates=candidates,
        feature_width=width,
        text_chars=chars,
        text_tokens=tokens,
        pixels=pixels,
        tensor_elements=elements,
        client_hint=min(max(request.complexity_hint, 0.0), 1.0),
        region=region,
    )
