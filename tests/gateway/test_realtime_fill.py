"""How many less urgent requests a batch of realtime requests takes (PoolDispatcher._realtime_size): only as
many as add at most ``realtime_fill_us`` of backend time by the pool's time per request, never past the
CPU stage's inline size; on a pool that is not started, with the real null backend and CPU stage object."""

from __future__ import annotations

import pytest

from tests.gateway.test_pool_admission import Answers, pool


@pytest.mark.parametrize(
    ("per_item_s", "size", "realtime", "taken"),
    [
        (0.0, 128, 1, 1),  # nothing observed yet: the realtime request alone
        (100e-6, 128, 1, 21),  # 2 ms of 0.1 ms requests: 20 others
        (10e-6, 128, 1, 32),  # cheap ones: up to the inline size (32)
        (5e-3, 128, 1, 1),  # a device's time per request: none
        (10e-6, 5, 1, 5),  # no more than are ready
        (10e-6, 128, 40, 40),  # realtime requests past the inline size: all of them, nothing else
        (100e-6, 128, 30, 32),
    ],
)
def test_a_realtime_batch_takes_others_as_far_as_their_time_allows(
    per_item_s: float, size: int, realtime: int, taken: int
) -> None:
    p = pool(256, Answers())
    assert p._realtime_fill_s == 0.002 and p._realtime_batch == 32  # the defaults
    p._ewma_item_s = per_item_s
    assert p._realtime_size(size, realtime) == taken
