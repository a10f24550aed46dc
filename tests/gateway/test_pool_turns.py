"""Between a pool's queues (one per model and text length bucket), the batcher's next batch goes to the
queue of the least served agent (fair queueing by requests served, gateway/dispatch/lanes.py ``Counts``),
after the class and before age; and a queue waiting for company does not hold back the ready queues of its
class. On the real null backend and CPU stage object, the batches recorded as they are cut (served at once,
as a batch on the loop is), the batcher's pass run directly."""

from __future__ import annotations

import time

from gateway.dispatch.work import WorkItem
from routing.types import Priority
from tests.gateway.test_pool_admission import requests
from tests.gateway.test_realtime_fill import HeldPool


class Recorded(HeldPool):
    """A started pool of one slot (concurrency 1, no reserve) whose batches are recorded and done at once
    (HeldPool, released from the start): one pass of its batcher cuts every batch that is ready, in the
    order it picks them."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(capacity=4096)
        self.pool._reserve = 0
        self.pool._delay_s = self.pool._realtime_delay_s = delay_s
        self.release.set()

    @property
    def batches(self) -> list[list[str]]:
        return [ids for _, ids in self.started]

    def queue(self, items: list[WorkItem], model: str, at: float) -> None:
        """Queue ``items`` for ``model`` as queued at ``at``, without the batcher's pass."""
        for item in items:
            item.request.model_name = model  # WorkItem.model reads it
        assert self.pool.submit_many(items, at)

    def cut(self) -> list[list[str]]:
        """The batcher's pass now; the batches it cut (as 'agent x n' per agent, in batch order)."""
        self.pool._batch_pass()
        out = []
        for batch in self.batches:
            agents: dict[str, int] = {}
            for rid in batch:
                agent = rid.split("-")[0]
                agents[agent] = agents.get(agent, 0) + 1
            out.append([f"{agent} x {n}" for agent, n in agents.items()])
        return out


def tagged(items: list[WorkItem], tag: str) -> list[WorkItem]:
    for i, item in enumerate(items):
        item.request.request_id = f"{item.agent_id}-{tag}-{i}".encode()
    return items


async def test_a_lone_request_in_a_queue_of_its_own_goes_in_the_next_batch_not_after_the_pools_older() -> (
    None
):
    """a's 64 ranking and 64 text requests queued first, b's one image request after: b's goes in the
    second batch (a was served in the first), not after all of a's (first come first served between the
    pool's queues, it went fifth: behind every batch of a's older requests, ~190 ms at p99 beside a flood
    on a simulated device, bench/realtime_under_load.py --queue-depth 256)."""
    recorded = Recorded()
    now = time.monotonic() - 1.0  # queued in the past: ready whatever the delay
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "rank"), "rank-mlp", now)
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "text"), "text-encoder", now + 0.001)
    recorded.queue(requests("b", 1, Priority.INTERACTIVE), "image-classifier", now + 0.002)
    assert recorded.cut() == [["a x 32"], ["b x 1"], ["a x 32"], ["a x 32"], ["a x 32"]]
    assert recorded.batches[0][0] == "a-rank-0"  # the oldest first, both being unserved
    assert recorded.pool.depth == 0 and recorded.pool._counts.served == {}  # none queued, none kept


async def test_a_lone_request_in_another_agents_queue_goes_with_its_next_batch() -> None:
    """a's text requests queued first, then its ranking ones and b's one ranking request: the ranking queue
    goes second (b not served yet), b's request in it (the lane shares the batch between a and b)."""
    recorded = Recorded()
    now = time.monotonic() - 1.0  # queued in the past: ready whatever the delay
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "text"), "text-encoder", now)
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "rank"), "rank-mlp", now + 0.001)
    recorded.queue(requests("b", 1, Priority.INTERACTIVE), "rank-mlp", now + 0.002)
    assert recorded.cut()[:2] == [["a x 32"], ["a x 31", "b x 1"]]


async def test_an_agent_sending_little_goes_first_in_every_queue_it_shares_with_a_flood() -> None:
    """a's flood in two queues, b's one request in each (as a lone agent's requests spread over a text
    model's length buckets): both of b's go in the first two batches. Ranked by the agent served longest
    ago (a turn per agent), b's second request waited for both of a's batches of the first queue: the two
    queues held a and b alike, and age decided."""
    recorded = Recorded()
    now = time.monotonic() - 1.0
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "x"), "rank-mlp", now)
    recorded.queue(tagged(requests("a", 64, Priority.INTERACTIVE), "y"), "text-encoder", now + 0.001)
    recorded.queue(tagged(requests("b", 1, Priority.INTERACTIVE), "x"), "rank-mlp", now + 0.002)
    recorded.queue(tagged(requests("b", 1, Priority.INTERACTIVE), "y"), "text-encoder", now + 0.003)
    shared = [["a x 31", "b x 1"]] * 2
    assert recorded.cut() == [*shared, ["a x 32"], ["a x 1"], ["a x 32"], ["a x 1"]]
    assert "b-y-0" in recorded.batches[1]


async def test_agents_served_take_turns_and_the_class_still_goes_first() -> None:
    """Two agents' floods in queues of their own: their batches alternate, the least served agent's
    first (age alone would serve a's three batches first); a batch request of c's, though c was never
    served, waits for every interactive one."""
    recorded = Recorded()
    now = time.monotonic() - 1.0  # queued in the past: ready whatever the delay
    recorded.queue(requests("c", 1, Priority.BATCH), "image-classifier", now - 1.0)
    recorded.queue(requests("a", 96, Priority.INTERACTIVE), "rank-mlp", now)
    recorded.queue(requests("b", 96, Priority.INTERACTIVE), "text-encoder", now + 0.001)
    alternating = [["a x 32"], ["b x 32"]] * 3
    assert recorded.cut() == [*alternating, ["c x 1"]]


async def test_a_queue_waiting_for_company_holds_back_no_ready_queue_of_its_class() -> None:
    """b's lone request ranks first (b never served; older, even) and waits for company (the pool's
    queue delay, 50 ms here); a's full batch of its class goes meanwhile (before, the first in line held
    every other queue for its delay), and the batcher wakes for b's when its delay is over. A realtime
    request waiting so still holds back the interactive ones (the class goes first)."""
    recorded = Recorded(delay_s=0.05)
    now = time.monotonic()
    recorded.queue(requests("b", 1, Priority.INTERACTIVE), "image-classifier", now)
    recorded.queue(requests("a", 32, Priority.INTERACTIVE), "rank-mlp", now)
    assert recorded.cut() == [["a x 32"]]
    assert recorded.pool.depth == 1 and recorded.pool._timer is not None  # b's, on its timer

    waiting = Recorded(delay_s=0.05)
    waiting.queue(requests("b", 1, Priority.REALTIME), "image-classifier", now)
    waiting.queue(requests("a", 32, Priority.INTERACTIVE), "rank-mlp", now)
    assert waiting.cut() == []
    assert waiting.pool.depth == 33 and waiting.pool._timer is not None
    for p in (recorded.pool, waiting.pool):
        await p.stop(1.0)
