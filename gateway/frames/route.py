"""Routing a frame's screened requests: per group where routing proves one decision, else in frame order.

Pure: the policy, the screened requests, the frame's region and the pools' signals at the frame's start
in; each decision with the requests (indices into the screened ones) it is for out. Every request gets
exactly the decision :meth:`TierPolicy.decide` gives it when the frame's requests are routed one by one
in frame order, each after the ones before it deepened the queues they went to (how the gateway routed
before frames were routed per group; tests/gateway/test_frame_route.py holds the two side by side). The
requests of each decision share model, version and class: each is queued as one slice of one lane.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.frames.groups import Screened
from routing.policy import TierPolicy, Unproven
from routing.types import Decision, PoolSignals, Priority, Reason, Tier

Routed = list[tuple[Decision, list[int]]]


def route_frame(
    policy: TierPolicy, screened: Screened, region: str, signals: Mapping[str, PoolSignals]
) -> Routed:
    """Each decision and its requests.

    Per group where :meth:`TierPolicy.decide_range` proves one decision whatever the queue depths this
    frame can lead to (each pool as deep as at the start plus every request of the frame): one call. A
    group whose scores straddle a tier threshold is tried again in halves by work, and so on; what
    the pools leave open (equal pools taking turns as each deepens, a pool that may fill or a deadline
    that may be missed within the frame) is routed request by request, in frame order, with the depths
    the requests before each one leave (:func:`_in_order`).
    """
    if len(screened) == 1:  # a lone request (the realtime fast path): its own decision, nothing to group
        return [(policy.decide(screened.profile(0, region), signals), [0])]
    deepest = {name: sig.queue_depth + len(screened) for name, sig in signals.items()}
    decided: Routed = []
    in_order: list[int] = []
    pending = screened.groups(policy.estimator)[::-1]  # a stack, first group on top
    while pending:
        group = pending.pop()
        decision = policy.decide_range(*screened.bounds(group, region), signals, deepest)
        if isinstance(decision, Decision):
            decided.append((decision, group.members))
            continue
        halves = screened.halves(group, policy.estimator) if decision is Unproven.SCORES else None
        if halves is None:
            in_order.extend(group.members)
        else:
            pending.extend(reversed(halves))
    if in_order:
        decided.extend(_in_order(policy, screened, region, signals, decided, sorted(in_order)))
    return decided


def _in_order(
    policy: TierPolicy,
    screened: Screened,
    region: str,
    signals: Mapping[str, PoolSignals],
    decided: Routed,
    indices: list[int],
) -> Routed:
    """The requests at ``indices`` decided one by one in frame order, each seeing every pool as the requests
    before it in the frame (those decided per group included) leave it, each one deeper by its class
    (PoolSignals.joined); those decided alike (tier, pool, reason, size bucket) and alike themselves (model,
    version, class: one queued slice each) returned together."""
    pool_of: dict[int, str] = {}
    for decision, members in decided:
        if decision.pool is not None and not decision.rejected:
            pool_of.update(dict.fromkeys(members, decision.pool))
    seen = dict(signals)
    priorities = screened.priorities
    # One queued slice is one model, version and class (PoolDispatcher.submit_many): decisions alike are
    # returned together only within those.
    alike: dict[tuple[Tier, str | None, Reason, int, str, str, Priority], tuple[Decision, list[int]]] = {}
    todo = iter(indices)
    upcoming = next(todo, None)
    for index in range(len(screened)):
        if index != upcoming:
            pool = pool_of.get(index)
            if pool is not None:
                seen[pool] = seen[pool].joined(priorities[index])
            continue
        upcoming = next(todo, None)
        decision = policy.decide(screened.profile(index, region), seen)
        if decision.pool is not None and not decision.rejected:
            seen[decision.pool] = seen[decision.pool].joined(priorities[index])
        request = screened.requests[index]
        key = (
            decision.tier,
            decision.pool,
            decision.reason,
            decision.size_bucket,
            request.model_name,
            request.model_version,
            priorities[index],
        )
        entry = alike.get(key)
        if entry is None:
            alike[key] = (decision, [index])
        else:
            entry[1].append(index)
    return list(alike.values())
