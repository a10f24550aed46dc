"""The local services waiting on the intake: who sent which request, and the frames that answer them.

A caller is its intake routing id: ``EdgeClient`` sets it to its caller id, stable across its reconnects
(and across its process restarts when the service passes one), and the spool keeps it with each request,
so a restarted agent still knows whom to answer.

Acks and answers go back without waiting: a caller that does not read must not hold up the intake for
every other. An answer that cannot go (the caller is not connected, or not reading) is parked
(``ParkedAnswers``: bounded, until its deadline) and handed over when the caller sends that request
again. Hong Kong's answers are passed on per caller once per loop tick, as one intake frame each (the
gateway sends up to 256 per frame), and their spool entries are released in one call.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Final

from edge_agent.parked import ParkedAnswers
from edge_agent.stats import FAIL_FAST_REASONS, AgentStats
from edgewire import FrameCodec, labels, now_unix_us, pb

MAX_RESPONSES_PER_FRAME: Final = 256  # answers to one local caller per intake frame
DEFAULT_PARKED_ANSWERS: Final = 20_000
DEFAULT_PARKED_BYTES: Final = 64 << 20

Send = Callable[[list[bytes]], bool]
"""Sends frames on the intake socket without waiting; False when they could not go (or no socket)."""


class Callers:
    """Routes Acks and answers to the intake callers; ``release`` gets the ids answered per tick."""

    def __init__(
        self,
        send: Send,
        agent_id: str,
        region: str,
        stats: AgentStats,
        release: Callable[[list[bytes]], None],
        parked: ParkedAnswers | None = None,
    ) -> None:
        self._send = send
        self._agent_id = agent_id
        self._region = region
        self._stats = stats
        self._release = release
        self.parked = parked or ParkedAnswers(DEFAULT_PARKED_ANSWERS, DEFAULT_PARKED_BYTES)
        self._codec = FrameCodec()  # intake frames: loopback, uncompressed
        # request id -> (routing id of the caller, the request's deadline in unix microseconds)
        self._waiting: dict[bytes, tuple[bytes, int]] = {}
        self._outbox: dict[bytes, list[tuple[pb.InferResponse, int]]] = {}
        self._outbox_ids: dict[bytes, bytes] = {}  # request id -> its caller, answered, in the outbox
        self._answered_ids: list[bytes] = []
        self._flush_scheduled = False
        self._purge_timer: asyncio.TimerHandle | None = None
        self._purge_due = 0.0  # unix microseconds the timer is set for

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def waiter(self, request_id: bytes) -> bytes | None:
        """The caller waiting for ``request_id`` (b"" when nobody known asked), or None if not waited for."""
        waiting = self._waiting.get(request_id)
        return None if waiting is None else waiting[0]

    def wait_for(self, request_id: bytes, caller: bytes, deadline_unix_us: int = 0) -> None:
        """``caller`` waits for the answer to ``request_id`` (from Hong Kong); b"": nobody known does."""
        self._waiting[request_id] = (caller, deadline_unix_us)

    def answering(self, request_id: bytes) -> bytes | None:
        """The caller whose answer to ``request_id`` came from Hong Kong and goes out at this tick's flush
        (no longer waited for, not yet sent), or None."""
        return self._outbox_ids.get(request_id)

    def give_up(self, request_id: bytes) -> None:
        """Nobody waits for ``request_id`` any more (it was refused after all)."""
        self._waiting.pop(request_id, None)

    def claim(self, caller: bytes, request_id: bytes) -> bool:
        """``caller`` asks again for ``request_id``: if an answer is parked for it, send it now (True)."""
        if request_id not in self.parked:  # the common case, asked for every new request: one lookup
            return False
        response = self.parked.claim(caller, request_id)
        if response is None:
            return False
        self._deliver(caller, [response], None)
        return True

    def ack(self, caller: bytes, ack: pb.Ack) -> None:
        """The Ack of one intake frame."""
        frames = self._codec.encode(ack, agent_id=self._agent_id, region=self._region, compress=False)
        if not self._send([caller, *frames]):
            self._stats.orphan_acks += 1

    def answer(
        self, caller: bytes, responses: list[pb.InferResponse], deadlines: Sequence[int] | None = None
    ) -> None:
        """Answer a local caller now; what cannot go is parked until the requests' ``deadlines`` (unix
        microseconds, one per response; None or 0: not known)."""
        if not responses:
            return
        for status, count in Counter([r.status for r in responses]).items():
            self._stats.responses[labels.STATUS.get(status, "other")] += count
        if not caller:  # nobody known asked (a request an older agent spooled): nobody to answer
            self._stats.orphan_responses += len(responses)
            return
        self._deliver(caller, responses, deadlines)

    def fail_fast(self, caller: bytes, request: pb.InferRequest, reason: str) -> None:
        """Answer DEADLINE_EXCEEDED now; ``reason`` is a FAIL_FAST_REASONS label."""
        self._stats.failed_fast[reason] += 1
        response = pb.InferResponse(
            request_id=request.request_id,
            status=pb.STATUS_DEADLINE_EXCEEDED,
            error_message=FAIL_FAST_REASONS[reason],
            model_name=request.model_name,
        )
        self.answer(caller, [response], [request.deadline_unix_us])

    def from_hong_kong(self, response: pb.InferResponse) -> None:
        """An answer from the uplink: to its caller at the end of this loop tick."""
        waiting = self._waiting.pop(response.request_id, None)
        self._answered_ids.append(response.request_id)
        caller, deadline = waiting if waiting is not None else (b"", 0)
        self._outbox.setdefault(caller, []).append((response, deadline))
        self._outbox_ids[response.request_id] = caller
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Release the answered requests, then answer each caller in frames of at most
        ``MAX_RESPONSES_PER_FRAME``."""
        self._flush_scheduled = False
        answered, self._answered_ids = self._answered_ids, []
        outbox, self._outbox = self._outbox, {}
        self._outbox_ids.clear()
        if answered:
            self._release(answered)
        for caller, answers in outbox.items():
            for start in range(0, len(answers), MAX_RESPONSES_PER_FRAME):
                chunk = answers[start : start + MAX_RESPONSES_PER_FRAME]
                self.answer(caller, [r for r, _ in chunk], [d for _, d in chunk])

    def close(self) -> None:
        """Stop the parked answers' expiry timer (the agent is closing)."""
        if self._purge_timer is not None:
            self._purge_timer.cancel()
            self._purge_timer = None

    def _deliver(
        self, caller: bytes, responses: list[pb.InferResponse], deadlines: Sequence[int] | None
    ) -> None:
        frames = self._codec.encode(
            pb.ResponseBatch(responses=responses),
            agent_id=self._agent_id,
            region=self._region,
            compress=False,
        )
        if self._send([caller, *frames]):
            return
        # Not connected (reconnecting, restarting) or not reading: kept until it asks again.
        for i, response in enumerate(responses):
            self.parked.park(caller, response, deadlines[i] if deadlines else 0)
        self._schedule_purge()

    def _schedule_purge(self) -> None:
        """Expired parked answers are dropped (and counted) when they expire, not at the next park."""
        due = self.parked.next_expiry_us()
        if due is None or (self._purge_timer is not None and self._purge_due <= due):
            return
        if self._purge_timer is not None:
            self._purge_timer.cancel()
        self._purge_due = due
        loop = asyncio.get_running_loop()
        self._purge_timer = loop.call_later(max(0.0, (due - now_unix_us()) / 1e6), self._purge)

    def _purge(self) -> None:
        self._purge_timer = None
        self.parked.purge()
        self._schedule_purge()
