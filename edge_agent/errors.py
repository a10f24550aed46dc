"""Unexpected errors the agent survives: each is logged where it is caught and counted here by reason.

A loop that must keep serving (the intake, the uplink's sender and receivers, the watchdog) catches what
it did not expect rather than end; the count makes that visible (``edge_errors_total{reason}``, every
reason exported from the start) and the log line says what failed and for whom.
"""

from __future__ import annotations

import enum
from collections import Counter


class ErrorReason(enum.StrEnum):
    """Where an error was caught: the ``reason`` label of ``edge_errors_total``."""

    TAKE_FRAME = "take_frame"  # deciding or spooling an intake frame raised; the frame got no Ack
    AFTER_COMMIT = "after_commit"  # finishing a frame after its fsync raised
    LOCAL_TIER = "local_tier"  # a local model call raised; its callers were answered INTERNAL
    RELOAD = "reload"  # SIGHUP's re-read failed; the running config stays
    SPOOL_WRITE = "spool_write"  # an append failed (disk full or failing); the request was refused
    SPOOL_ACK = "spool_ack"  # releasing answered or accepted requests failed; a restart may resend them
    SPOOL_FSYNC = "spool_fsync"  # a group fsync failed; the frames it covered were refused
    SPOOL_PURGE = "spool_purge"  # dropping expired records failed; retried a second later
    UPLINK_SEND = "uplink_send"  # building or sending a frame to Hong Kong raised
    GATEWAY_FRAME = "gateway_frame"  # handling a frame from Hong Kong raised
    UPLINK_TIMERS = "uplink_timers"  # the uplink's timers (resends, expiry) raised


class ErrorCounts:
    """Errors caught and survived, by reason; shared by the agent's parts, read by its metrics."""

    def __init__(self) -> None:
        self.by_reason: Counter[ErrorReason] = Counter(dict.fromkeys(ErrorReason, 0))

    def count(self, reason: ErrorReason) -> None:
        self.by_reason[reason] += 1
