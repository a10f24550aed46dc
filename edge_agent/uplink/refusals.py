"""What the gateway's refusals mean to the agent: resend, split, or answer the caller with a status."""

from __future__ import annotations

import enum
from typing import Final

from edgewire import pb

RETRYABLE_NACKS: Final = frozenset({pb.NACK_REASON_OVERLOADED, pb.NACK_REASON_DRAINING})
FINAL_NACK_STATUS: Final = {
    pb.NACK_REASON_DEADLINE_EXPIRED: pb.STATUS_DEADLINE_EXCEEDED,
    pb.NACK_REASON_INVALID_REQUEST: pb.STATUS_INVALID_ARGUMENT,
    pb.NACK_REASON_UNKNOWN_MODEL: pb.STATUS_MODEL_NOT_FOUND,
}
RESENDABLE_REJECTS: Final = frozenset(
    {
        pb.REJECT_REASON_UNKNOWN_DICTIONARY,
        pb.REJECT_REASON_FRAME_TOO_LARGE,
        pb.REJECT_REASON_DECLARED_TOO_LARGE,
        pb.REJECT_REASON_TOO_MANY_RECORDS,
    }
)
HANDLED_REJECTS: Final = RESENDABLE_REJECTS | {pb.REJECT_REASON_OVER_BUDGET}
"""Frame refusals the agent deals with itself (split, resent, or held back and resent): nothing for an
operator to fix on the agent; every other refusal fails the frame's requests."""
OVER_BUDGET_WAIT_MS: Final = 500
"""The wait after an ``over_budget`` refusal that names none (a gateway's ``frame_retry_after_ms`` is 0): its
default retry-after for other refusals."""


class RejectAction(enum.Enum):
    """What to do with the requests of a frame the gateway refused whole."""

    RESEND = "resend"  # as they are (the dictionary is dropped first)
    SPLIT = "split"  # in frames of half as many records; a frame of one can never pass: failed
    WAIT = "wait"  # over this agent's budget there: resent, and no frame to that gateway, after the wait
    FAIL = "fail"  # misconfiguration (version, agent id): each answered INTERNAL


def reject_action(reason: int) -> RejectAction:
    if reason == pb.REJECT_REASON_UNKNOWN_DICTIONARY:
        return RejectAction.RESEND
    if reason in RESENDABLE_REJECTS:
        return RejectAction.SPLIT
    if reason == pb.REJECT_REASON_OVER_BUDGET:
        return RejectAction.WAIT
    return RejectAction.FAIL


def nack_resend_reason(reason: int) -> str:
    """The ``edge_resent_total`` label of a retryable nack."""
    return "nack_overloaded" if reason == pb.NACK_REASON_OVERLOADED else "nack_draining"
