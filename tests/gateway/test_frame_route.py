"""route_frame (per group) decides every request exactly as routing the frame one request at a time did.

The reference is the gateway's routing before frames were routed per group: each screened request in
frame order gets TierPolicy.decide with the pools' signals as the requests before it left them (a pool
one of them went to is one deeper). Generated frames mix ranking and text requests of many sizes, hints
and deadlines, with signals from idle to nearly full and two policies: the default one, and one whose
cloud pools are equal (so they take turns within a frame).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from edgewire import pb
from gateway.frames.groups import Screened
from gateway.frames.route import route_frame
from inference.profile import profile_of, wire_priority
from routing import PoolSignals, TierPolicy
from routing.config import DEFAULT_ROUTING_SECTION, load_routing_config
from routing.types import Priority

DEFAULT = TierPolicy(load_routing_config(DEFAULT_ROUTING_SECTION))


def _equal_pools() -> TierPolicy:
    section: dict[str, Any] = copy.deepcopy(DEFAULT_ROUTING_SECTION)
    for pool in section["pools"]:
        pool["speed"] = 1.0
        pool["concurrency"] = 8
        pool["max_queue_depth"] = 4096
    return TierPolicy(load_routing_config(section))


EQUAL = _equal_pools()
WORDS = ["red", "shoes", "running", "men", "size", "10", "waterproof", "jacket", "連帽", "外套"]

request_st = st.one_of(
    st.tuples(
        st.just("rank-mlp"),
        st.integers(1, 64),
        st.sampled_from([8, 16, 24]),
        st.sampled_from([0.0, 0.0, 0.3, 0.8]),
        st.sampled_from([0, pb.PRIORITY_CLASS_REALTIME, pb.PRIORITY_CLASS_BATCH]),
        st.sampled_from([0, 1]),
    ),
    st.tuples(
        st.just("text-encoder"),
        st.integers(1, 40),
        st.integers(0, len(WORDS) - 1),
        st.sampled_from([0.0, 0.0, 0.9]),
        st.just(0),
        st.sampled_from([0, 1]),
    ),
)
"""(model, size, width or first word, hint, priority, own deadline?) of a request."""


def _request(model: str, size: int, other: int, hint: float, priority: int, own: int) -> pb.InferRequest:
    if model == "rank-mlp":
        return pb.InferRequest(
            model_name=model,
            kind=pb.REQUEST_KIND_RANKING,
            priority=priority,  # type: ignore[arg-type]
            complexity_hint=hint,
            deadline_unix_us=own,
            ranking=pb.RankingFeatures(candidate_item_ids=list(range(size)), candidate_feature_width=other),
        )
    text = " ".join(WORDS[(other + n) % len(WORDS)] for n in range(size))
    return pb.InferRequest(
        model_name=model,
        kind=pb.REQUEST_KIND_TEXT,
        complexity_hint=hint,
        deadline_unix_us=own,
        text=pb.TextQuery(text=text),
    )


@st.composite
def signals_st(draw: st.DrawFn) -> PoolSignals:
    """A pool's signals; where its queue is served by class, of its depth some realtime, some interactive."""
    depth = draw(st.sampled_from([0, 0, 5, 30, 60, 120, 250, 4090]))
    urgent = None
    if draw(st.booleans()):
        realtime = draw(st.integers(0, depth))
        urgent = (realtime, realtime + draw(st.integers(0, depth - realtime)))
    return PoolSignals(
        queue_depth=depth,
        ewma_latency_s=draw(st.sampled_from([0.0, 0.0005, 0.01])),
        healthy=draw(st.sampled_from([True, True, True, False])),
        concurrency=draw(st.sampled_from([0, 4])),
        urgent_depth=urgent,
    )


def _reference(
    policy: TierPolicy, screened: Screened, region: str, signals: dict[str, PoolSignals]
) -> list[tuple[object, ...]]:
    """One request at a time, in frame order (the gateway's routing before route_frame): each queued one
    deepens its pool, and the wait of requests as urgent as it or less."""
    signals = dict(signals)
    out: list[tuple[object, ...]] = []
    for request, priority, remaining in zip(
        screened.requests, screened.priorities, screened.remaining, strict=True
    ):
        decision = policy.decide(profile_of(request, priority, remaining, region), signals)
        out.append((decision.tier, decision.pool, decision.reason, decision.size_bucket))
        if decision.pool is not None and not decision.rejected:
            sig = signals[decision.pool]
            urgent = sig.urgent_depth
            if urgent is not None:  # written out, not PoolSignals.joined: the reference for it too
                urgent = (
                    urgent[0] + (priority is Priority.REALTIME),
                    urgent[1] + (priority is not Priority.BATCH),
                )
            signals[decision.pool] = replace(sig, queue_depth=sig.queue_depth + 1, urgent_depth=urgent)
    return out


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(request_st, min_size=1, max_size=100),
    deadlines=st.lists(st.sampled_from([None, 0.004, 0.02, 0.3, 5.0]), min_size=1, max_size=3),
    equal=st.booleans(),
    region=st.sampled_from(["us-west", "eu-west", "unknown"]),
    signals=st.lists(signals_st(), min_size=4, max_size=4),
)
def test_per_group_routing_is_request_by_request_routing(
    *,
    requests: list[tuple[str, int, int, float, int, int]],
    deadlines: list[float | None],
    equal: bool,
    region: str,
    signals: list[PoolSignals],
) -> None:
    policy = EQUAL if equal else DEFAULT
    pool_signals = dict(zip(policy.pool_names, signals, strict=False))
    screened = Screened()
    for n, fields in enumerate(requests):
        request = _request(*fields)
        # A request's deadline_unix_us (0 or 1 above) picks the frame's deadline or one of its own.
        remaining = deadlines[0] if not request.deadline_unix_us else deadlines[n % len(deadlines)]
        screened.add(request, wire_priority(request.priority), remaining)
    got: list[tuple[object, ...] | None] = [None] * len(screened)
    for decision, members in route_frame(policy, screened, region, pool_signals):
        # one queued slice each (PoolDispatcher.submit_many): one model, version and class
        assert len({_slice_of(screened, index) for index in members}) == 1
        for index in members:
            assert got[index] is None, "a request decided twice"
            got[index] = (decision.tier, decision.pool, decision.reason, decision.size_bucket)
    assert got == _reference(policy, screened, region, pool_signals)


def _slice_of(screened: Screened, index: int) -> tuple[str, str, Priority]:
    request = screened.requests[index]
    return request.model_name, request.model_version, screened.priorities[index]


def test_requests_routed_in_frame_order_alike_are_returned_apart_by_class_and_model() -> None:
    """Pools nearly full (2 from their bound): the frame is routed request by request. A realtime and a
    batch request decided alike (same pool, reason, bucket) come back as two entries, as each entry is
    queued as one slice in one lane; one entry put the batch request in the realtime lane."""
    signals = {name: PoolSignals(4094, 0.0005, True, 4, (0, 0)) for name in EQUAL.pool_names}
    screened = Screened()
    for priority, remaining in ((pb.PRIORITY_CLASS_REALTIME, 0.3), (pb.PRIORITY_CLASS_BATCH, None)):
        request = _request("rank-mlp", 8, 8, 0.0, priority, 0)
        screened.add(request, wire_priority(request.priority), remaining)
    routed = route_frame(EQUAL, screened, "us-west", signals)
    assert len({(d.tier, d.pool, d.reason, d.size_bucket) for d, _ in routed}) == 1  # decided alike
    assert sorted(members for _, members in routed) == [[0], [1]]


def test_an_ordinary_frame_is_routed_in_a_few_decisions() -> None:
    """The point of it: a frame of 100 ranking and text requests on idle pools takes a handful of
    decisions (one per group), not 100."""
    screened = Screened()
    for n in range(100):
        if n % 2:
            request = pb.InferRequest(
                model_name="rank-mlp",
                kind=pb.REQUEST_KIND_RANKING,
                ranking=pb.RankingFeatures(
                    candidate_item_ids=list(range(8 + n % 25)), candidate_feature_width=16
                ),
            )
        else:
            request = pb.InferRequest(
                model_name="text-encoder",
                kind=pb.REQUEST_KIND_TEXT,
                text=pb.TextQuery(text="red shoes " * (1 + n % 5)),
            )
        screened.add(request, wire_priority(0), 5.0)
    signals = {name: PoolSignals() for name in EQUAL.pool_names}
    routed = route_frame(EQUAL, screened, "us-west", signals)
    assert sum(len(members) for _, members in routed) == 100
    assert len(routed) <= 8
