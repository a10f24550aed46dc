"""The local services waiting on the intake: who sent which request, and the frames that answer them.

Acks and answers go back without waiting: a caller that does not read must not hold up the intake for
every other (it gets no Ack, and its requests are answered or time out). Hong Kong's answers are passed on
per caller once per loop tick, as one intake frame each (the gateway sends up to 256 per frame), and their
spool entries are released in one call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

from edge_agent.stats import FAIL_FAST_REASONS, AgentStats
from edgewire import FrameCodec, labels, pb

MAX_RESPONSES_PER_FRAME: Final = 256  # answers to one local caller per intake frame

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
    ) -> None:
        self._send = send
        self._agent_id = agent_id
        self._region = region
        self._stats = stats
        self._release = release
        self._codec = FrameCodec()  # intake frames: loopback, uncompressed
        self._waiting: dict[bytes, bytes] = {}  # request id -> intake routing id of the caller
        self._outbox: dict[bytes, list[pb.InferResponse]] = {}
        self._answered_ids: list[bytes] = []
        self._flush_scheduled = False

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def wait_for(self, request_id: bytes, caller: bytes) -> None:
        """``caller`` waits for the answer to ``request_id`` (from Hong Kong)."""
        self._waiting[request_id] = caller

    def give_up(self, request_id: bytes) -> None:
        """Nobody waits for ``request_id`` any more (it was refused after all)."""
        self._waiting.pop(request_id, None)

    def ack(self, caller: bytes, ack: pb.Ack) -> None:
        """The Ack of one intake frame."""
        frames = self._codec.encode(ack, agent_id=self._agent_id, region=self._region, compress=False)
        if not self._send([caller, *frames]):
            self._stats.orphan_acks += 1

    def answer(self, caller: bytes, responses: list[pb.InferResponse]) -> None:
        """Answer a local caller now (loopback frames are not worth compressing)."""
        if not responses:
            return
        for response in responses:
            self._stats.responses[labels.STATUS.get(response.status, "other")] += 1
        frames = self._codec.encode(
            pb.ResponseBatch(responses=responses),
            agent_id=self._agent_id,
            region=self._region,
            compress=False,
        )
        if not self._send([caller, *frames]):  # the caller has gone (or is not reading)
            self._stats.orphan_responses += len(responses)

    def fail_fast(self, caller: bytes, request: pb.InferRequest, reason: str) -> None:
        """Answer DEADLINE_EXCEEDED now; ``reason`` is a FAIL_FAST_REASONS label."""
        self._stats.failed_fast[reason] += 1
        response = pb.InferResponse(
            request_id=request.request_id,
            status=pb.STATUS_DEADLINE_EXCEEDED,
            error_message=FAIL_FAST_REASONS[reason],
            model_name=request.model_name,
        )
        self.answer(caller, [response])

    def from_hong_kong(self, response: pb.InferResponse) -> None:
        """An answer from the uplink: to its caller at the end of this loop tick."""
        caller = self._waiting.pop(response.request_id, None)
        self._answered_ids.append(response.request_id)
        if caller is None:
            self._stats.orphan_responses += 1
        else:
            self._outbox.setdefault(caller, []).append(response)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Release the answered requests, then answer each caller in frames of at most
        ``MAX_RESPONSES_PER_FRAME``."""
        self._flush_scheduled = False
        answered, self._answered_ids = self._answered_ids, []
        outbox, self._outbox = self._outbox, {}
        if answered:
            self._release(answered)
        for caller, responses in outbox.items():
            for start in range(0, len(responses), MAX_RESPONSES_PER_FRAME):
                self.answer(caller, responses[start : start + MAX_RESPONSES_PER_FRAME])
