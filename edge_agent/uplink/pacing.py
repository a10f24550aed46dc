"""How much the agent lets the gateway hold at once: a congestion window over requests, not bytes.

After a gateway restart the agent holds a backlog (spooled while it was down, and what the old process
had accepted) far larger than the gateway's pool queues. Sent at once, most of it was refused OVERLOADED
and resent together after the same retry-after, again and again. The window paces it as TCP paces a
connection (RFC 5681): it counts the requests sent and not yet answered or refused, starts at
``initial``, opens by one for each answer (slow start: it doubles per round of answers) up to the slow
start threshold and by 1/window per answer after it (additive increase), and halves on an OVERLOADED
refusal (multiplicative decrease), at most once per round: refusals of requests sent before the last cut
do not cut again. It is clocked by answers, not by Acks, because the gateway acks a request as soon as it
is queued: an Ack says a queue had room, an answer says the gateway finished work and has room again.

Why the agent decides and the gateway does not grant credit: the gateway's room is per pool, and which
pool a request takes is decided per request by the routing policy as it arrives, so no single number the
gateway could send says how many of a given agent's next requests fit; and a window needs no wire change,
works with every gateway version, and is per agent, so that agents converge to a fair share on their own
(AIMD's property). The gateway's retry-after stays the floor for a refused request's resend.
"""

from __future__ import annotations

import math


class SendWindow:
    """Requests the gateway may hold from this agent; the holding count is the caller's (``held``)."""

    def __init__(self, initial: int, minimum: int, maximum: int) -> None:
        self.maximum = max(1, maximum)
        self.minimum = max(1, min(minimum, self.maximum))
        self.initial = max(self.minimum, min(initial, self.maximum))
        self.size = float(self.initial)
        self.threshold = math.inf  # slow start until the first cut
        self._cut_at = -math.inf  # requests sent before this do not cut again
        self.cuts = 0
        self.restarts = 0

    def room(self, held: int) -> int:
        """How many more requests may go now, with ``held`` at the gateway."""
        return max(0, int(self.size) - held)

    def answered(self, n: int, held: int) -> None:
        """``n`` of the ``held`` requests at the gateway were answered: the window opens, if it was in use
        (at least half full: RFC 7661's rule, so that light traffic does not grow a window that a burst
        or a slow gateway would then find far above what the gateway holds)."""
        if 2 * held < self.size:
            return
        if self.size < self.threshold:
            self.size = min(self.size + n, self.threshold)
        else:
            self.size += n / self.size
        self.size = min(self.size, float(self.maximum))

    def overloaded(self, sent_at: float, now: float) -> bool:
        """A request sent at ``sent_at`` was refused OVERLOADED at ``now``: halve the window, unless it was
        sent before the last cut (that cut answered this round already). True when it cut."""
        if sent_at < self._cut_at:
            return False
        self.size = max(float(self.minimum), self.size / 2)
        self.threshold = self.size
        self._cut_at = now
        self.cuts += 1
        return True

    def restart(self, now: float) -> None:
        """The gateway restarted: its queues are empty and its room unknown; slow start again."""
        self.size = float(self.initial)
        self.threshold = math.inf
        self._cut_at = now
        self.restarts += 1
