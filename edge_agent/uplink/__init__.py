"""The uplink to Hong Kong: one DEALER per carrier ingress (the zguide Freelance pattern), with liveness
and RTT per carrier, batching, acknowledgement tracking, failover resends and gateway-restart recovery.

Every request sent stays *outstanding* until its response arrives or its deadline passes:

* unacknowledged: sent in a frame that got no Ack yet. When the frame's carrier dies (no Pong for
  ``dead_after_s``) or the Ack does not come within ``ack_timeout_s``, the request is resent on the best
  other carrier with ``attempt + 1``; the gateway's shared dedupe window makes that safe.
* accepted: the gateway owns it (the agent's spool keeps it until it is answered). If the carrier it went
  on goes silent or is removed, its answer may be lost with it: at the next Pong on a live carrier of the
  same gateway epoch it is re-asked there, ahead of new requests and outside the send window (the gateway
  already holds it, so it adds no load); the gateway acknowledges it as a duplicate and answers it once, on
  the re-ask's carrier (joining it if it still runs, from its response cache if it had answered already).
  If the gateway's epoch changes (it restarted and lost its in-memory work), accepted requests still
  waiting are resent; these re-executions are counted and bounded by ``max_inflight``.

A response for an id no longer outstanding (already answered, or a second copy after a failover) is
dropped and counted, so a caller never receives two answers.

Modules: ``carriers`` (sockets, liveness, choice), ``outstanding`` (what is owed an answer or an Ack, with
its timers), ``send_queue`` (what the next frame carries), ``refusals`` (what a refusal means),
``dictionaries`` (which zstd dictionary), ``link`` (``Uplink``, which ties them to the sockets).
"""

from edge_agent.uplink.carriers import Carrier
from edge_agent.uplink.link import Uplink, UplinkStats
from edge_agent.uplink.outstanding import Outstanding, OutstandingTable
from edge_agent.uplink.refusals import (
    FINAL_NACK_STATUS,
    HANDLED_REJECTS,
    RESENDABLE_REJECTS,
    RETRYABLE_NACKS,
)

__all__ = [
    "FINAL_NACK_STATUS",
    "HANDLED_REJECTS",
    "RESENDABLE_REJECTS",
    "RETRYABLE_NACKS",
    "Carrier",
    "Outstanding",
    "OutstandingTable",
    "Uplink",
    "UplinkStats",
]
