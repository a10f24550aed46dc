"""The intake's decision table: what becomes of each request of a frame (docs/AGENT.md section 4).

In order: an id its caller sent before is re-attached (the caller reconnected: it waits again, or gets
its parked answer now), an id used by another caller is refused; the routing policy's edge-device tier
with a local model serves it here; a realtime request whose deadline cannot cover the round trip is
served locally where a model exists, else failed fast; with the in-flight window full it is refused
(retryable); a spooled class is appended to the spool with its caller's identity (refused when the spool
does not store it); the rest goes to Hong Kong. Under ``fsync = "batch"`` the spooled requests and the
frame's Ack wait for a group fsync that covers them.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

import structlog

from edge_agent.callers import Callers
from edge_agent.config import AgentConfig
from edge_agent.errors import ErrorCounts, ErrorReason
from edge_agent.local_batcher import LocalBatcher, ModelKey
from edge_agent.spool import GroupCommit, Spool
from edge_agent.stats import AgentStats
from edge_agent.uplink import Uplink
from edgewire import is_valid_id, new_id, now_unix_us, pb
from inference.profile import profile_of, wire_priority
from routing.holder import PolicyHolder
from routing.policy import TierPolicy
from routing.types import Priority, Tier

log = structlog.get_logger("edge_agent")

RETRY_AFTER_MS = 200  # of an intake refusal: the window or the spool is full


def durable_caller(caller: bytes) -> bytes:
    """The identity a restarted agent can answer: the caller's routing id, unless libzmq made it up (it
    starts with a zero byte and is not seen again after a reconnect); b"" then."""
    return caller if caller[:1] != b"\x00" else b""


class Route(enum.Enum):
    """Where a request goes once its id is known to be new."""

    LOCAL = "local"
    FAIL_FAST = "fail_fast"
    HONG_KONG = "hong_kong"


class Admission:
    """Takes the requests of one intake frame: decides, spools, queues and sends them, and Acks the frame."""

    def __init__(
        self,
        config: AgentConfig,
        policy: PolicyHolder,
        uplink: Uplink,
        spool: Spool,
        commit: GroupCommit | None,
        local: LocalBatcher | None,
        callers: Callers,
        stats: AgentStats,
        errors: ErrorCounts,
    ) -> None:
        self._config = config
        self._policy = policy
        self._uplink = uplink
        self._spool = spool
        self._commit = commit
        self._local = local
        self._callers = callers
        self._stats = stats
        self._errors = errors
        self.reserved = 0  # spooled requests counted against the in-flight window, not yet submitted
        self.reattached = 0  # requests sent again by their caller and attached to what the agent held

    def take(self, caller: bytes, requests: list[pb.InferRequest]) -> Coroutine[Any, Any, None] | None:
        """Decide, spool, queue and send what a frame holds; the Ack goes back now, or, when requests of
        it wait for the spool's fsync, from the coroutine returned (the caller runs it)."""
        ack = pb.Ack(acked_message_id=new_id())
        local: defaultdict[ModelKey, list[pb.InferRequest]] = defaultdict(list)
        direct: list[pb.InferRequest] = []  # to Hong Kong now
        spooled: list[pb.InferRequest] = []  # to Hong Kong once the spool's fsync covers them
        spooled_raw: list[bytes] = []  # their serialized form, written to the spool and sent as it is
        policy = self._policy.policy
        wall = now_unix_us()
        rtt = self._uplink.rtt_s()
        self._stats.received += len(requests)
        # The frame's spool records are written together when the loop ends (one write, not one each).
        with self._spool.batch() as written:
            for request in requests:
                if not self._new_id(caller, request, ack):
                    continue
                route = self._route(request, policy, wall, rtt)
                if route is Route.LOCAL:
                    local[(request.model_name, request.model_version)].append(request)
                elif route is Route.FAIL_FAST:
                    self._callers.fail_fast(caller, request, "round_trip")
                elif not self._uplink.has_room(
                    self.reserved + len(direct) + len(spooled) + 1,
                    realtime=request.priority == pb.PRIORITY_CLASS_REALTIME,
                ):
                    self._refuse(ack, request, "agent in-flight window full")
                elif wire_priority(request.priority).value not in self._config.spool.classes:
                    direct.append(request)
                    self._callers.wait_for(request.request_id, caller, request.deadline_unix_us)
                else:
                    raw = self._append(caller, request, ack)
                    if raw is not None:
                        spooled.append(request)
                        spooled_raw.append(raw)
                        self._callers.wait_for(request.request_id, caller, request.deadline_unix_us)
        if written.failed:
            spooled, spooled_raw = self._write_failed(ack, written.failed, spooled, spooled_raw)
        if local and self._local is not None:
            self._local.add(caller, local)
        self._accept(ack, direct)
        if spooled and self._commit is not None:
            # They wait for an fsync that covers them, holding their place in the in-flight window.
            self.reserved += len(spooled)
            return self._after_commit(caller, ack, spooled, spooled_raw)
        self._accept(ack, spooled, spooled_raw)
        self._callers.ack(caller, ack)
        return None

    def _new_id(self, caller: bytes, request: pb.InferRequest, ack: pb.Ack) -> bool:
        """Give a request without a valid id a new one (True). An id this agent holds is not taken again
        (False): sent again by the caller it is held for (after a reconnect, or a restart of either side),
        it is re-attached, listed in the Ack's ``duplicate_ids``, and its parked answer, if any, goes now
        (one that came from Hong Kong in this tick goes at its flush, right after this frame's Ack); an id
        held for another caller, or answered already, is refused."""
        rid = request.request_id
        if not is_valid_id(rid):
            request.request_id = new_id()
            return True
        callers = self._callers
        waiter = callers.waiter(rid)
        if waiter is None and (callers.claim(caller, rid) or callers.answering(rid) == caller):
            # Its answer is parked (sent now) or came in this tick (the flush sends it): refused as used,
            # the caller's resend would end its wait before the answer it is owed (the Ack goes first).
            waiter = caller
        elif waiter == b"":  # spooled by an agent that did not record callers: this one asks for it
            self._callers.wait_for(rid, caller, request.deadline_unix_us)
            waiter = caller
        if waiter == caller:
            ack.duplicate_ids.append(rid)
            self.reattached += 1
            return False
        if waiter is not None or self._uplink.knows(rid):
            ack.nacks.append(
                pb.Nack(
                    request_id=rid,
                    reason=pb.NACK_REASON_INVALID_REQUEST,
                    detail="request id already used: every request needs a new id",
                )
            )
            return False
        return True

    def _route(self, request: pb.InferRequest, policy: TierPolicy, wall: int, rtt: float | None) -> Route:
        """The routing policy's tier, then the realtime rule: the round trip to Hong Kong plus the
        estimated service time must fit the deadline."""
        if not request.deadline_unix_us:
            # Nothing waits forever: a request without a deadline gets the configured default.
            request.deadline_unix_us = wall + int(self._config.default_deadline_s * 1e6)
        priority = wire_priority(request.priority)
        can_local = self._local is not None and self._local.serves(request.model_name, request.model_version)
        if not can_local and priority is not Priority.REALTIME:
            # The policy's tier only matters where a local model could serve the request, and the round
            # trip only for realtime ones: the rest go to Hong Kong whatever the policy says (it is pure).
            return Route.HONG_KONG
        remaining = (request.deadline_unix_us - wall) / 1e6
        profile = profile_of(request, priority, remaining, self._config.region)
        decision = policy.tier_for(profile)
        if decision.tier is Tier.EDGE_DEVICE and can_local:
            return Route.LOCAL
        if priority is Priority.REALTIME:
            service = policy.estimator.service_time(profile, decision.score, decision.size_bucket)
            needed = (rtt if rtt is not None else float("inf")) + service
            if needed > remaining:
                return Route.LOCAL if can_local else Route.FAIL_FAST
        return Route.HONG_KONG

    def _append(self, caller: bytes, request: pb.InferRequest, ack: pb.Ack) -> bytes | None:
        """Append a spooled class's request to the spool; its serialized form, or None when refused (the
        Ack says why)."""
        raw = request.SerializeToString()
        try:
            result = str(
                self._spool.append(
                    request.request_id, raw, request.deadline_unix_us / 1e6, durable_caller(caller)
                )
            )
        except OSError as exc:  # a full or failing disk: refuse (retryable), keep serving
            self._errors.count(ErrorReason.SPOOL_WRITE)
            log.error("spool write failed", error=str(exc))
            result = "write_failed"
        if result != "stored":
            self._refuse(ack, request, f"spool full ({result})")
            return None
        return raw

    def _write_failed(
        self, ack: pb.Ack, failed: dict[bytes, OSError], spooled: list[pb.InferRequest], raws: list[bytes]
    ) -> tuple[list[pb.InferRequest], list[bytes]]:
        """Records of the frame that the spool could not write after all: refused as a failed append is."""
        self._errors.count(ErrorReason.SPOOL_WRITE)
        log.error("spool write failed", error=str(next(iter(failed.values()))), requests=len(failed))
        kept: list[pb.InferRequest] = []
        kept_raw: list[bytes] = []
        for request, raw in zip(spooled, raws, strict=True):
            if request.request_id in failed:
                self._callers.give_up(request.request_id)
                self._refuse(ack, request, "spool full (write_failed)")
            else:
                kept.append(request)
                kept_raw.append(raw)
        return kept, kept_raw

    async def _after_commit(
        self, caller: bytes, ack: pb.Ack, spooled: list[pb.InferRequest], raws: list[bytes]
    ) -> None:
        """The rest of a frame whose spooled requests wait for an fsync: send them and the Ack after it."""
        assert self._commit is not None
        reserved = len(spooled)
        try:
            try:
                await self._commit.commit()
            except OSError as exc:
                self._take_back(ack, spooled, exc)
            else:
                self._accept(ack, spooled, raws)
            finally:
                self.reserved -= reserved
            self._callers.ack(caller, ack)
        except Exception:  # a bug here must not go unseen: the task is not awaited by anyone
            self._errors.count(ErrorReason.AFTER_COMMIT)
            log.exception("taking a batch from a local service failed", requests=len(spooled))

    def _accept(self, ack: pb.Ack, requests: list[pb.InferRequest], raws: list[bytes] | None = None) -> None:
        """Hand requests to the uplink (``raws``: their serialized form, when made already) and list them
        as accepted in the caller's Ack."""
        if requests:
            self._uplink.submit(requests, raws)
            self._stats.remote += len(requests)
            ack.accepted_ids.extend(r.request_id for r in requests)

    def _take_back(self, ack: pb.Ack, spooled: list[pb.InferRequest], exc: OSError) -> None:
        """The spool could not make ``spooled`` durable: refuse them (retryable) rather than acknowledge
        what a power loss could lose, and tombstone them so a restart does not resend them."""
        self._errors.count(ErrorReason.SPOOL_FSYNC)
        log.error("spool fsync failed; refusing the frame's spooled requests", error=str(exc))
        try:
            self._spool.ack([r.request_id for r in spooled])
        except OSError as again:  # the disk is failing: a restart may resend them, nobody waits for those
            self._errors.count(ErrorReason.SPOOL_ACK)
            log.error("spool tombstones failed", error=str(again))
        for request in spooled:
            self._callers.give_up(request.request_id)
            self._refuse(ack, request, "spool fsync failed")

    def _refuse(self, ack: pb.Ack, request: pb.InferRequest, detail: str) -> None:
        self._stats.refused += 1
        ack.nacks.append(
            pb.Nack(
                request_id=request.request_id,
                reason=pb.NACK_REASON_OVERLOADED,
                retry_after_ms=RETRY_AFTER_MS,
                detail=detail,
            )
        )
