"""Placement (gateway/shards/placement.py) and the supervisor's back-off: which shard serves an agent, how
many shards and CPU workers a host gets by default, and how soon a dead shard is started again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from gateway.shards.placement import (
    MAX_SHARDS,
    default_shards,
    default_workers,
    per_shard_concurrency,
    shard_of,
)
from gateway.shards.supervisor import FIRST_DELAY_S, MAX_DELAY_S, STEADY_S, restart_delay

AGENTS = [f"hk-agent-{n:04d}" for n in range(1000)]


def test_shard_of_is_pinned_by_crc32() -> None:
    """crc32 of the id, modulo the count: the same on every host and in every release (a change would move
    agents between shards, and a resend would miss the dedupe window of the shard that accepted it)."""
    assert shard_of("test-agent", 2) == 0
    assert shard_of("edge-us-west-1", 2) == 0
    assert shard_of("edge-us-west-1", 7) == 4
    assert shard_of("hk-agent-0042", 16) == 7


def test_shard_of_is_stable_across_processes() -> None:
    """No per-process hash seed: another interpreter with another PYTHONHASHSEED places every agent alike."""
    here = {n: [shard_of(a, n) for a in AGENTS] for n in (2, 7)}
    code = (
        "import json, sys\n"
        "from gateway.shards.placement import shard_of\n"
        "agents = json.load(sys.stdin)\n"
        "print(json.dumps({n: [shard_of(a, n) for a in agents] for n in (2, 7)}))\n"
    )
    for seed in ("1", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(AGENTS),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        there = {int(n): v for n, v in json.loads(out.stdout).items()}
        assert there == here, f"PYTHONHASHSEED={seed} placed agents differently"


@pytest.mark.parametrize("shards", [2, 7])
def test_shard_of_spreads_agents_fairly(shards: int) -> None:
    """1000 agent ids: every shard gets some, each within a loose band around its fair share."""
    counts = Counter(shard_of(a, shards) for a in AGENTS)
    assert set(counts) == set(range(shards))
    fair = len(AGENTS) / shards
    for index, count in counts.items():
        assert 0.75 * fair <= count <= 1.25 * fair, (index, count, fair)


def test_shard_of_is_in_range_and_one_shard_takes_all() -> None:
    assert {shard_of(a, 1) for a in AGENTS} == {0}
    assert {shard_of(a, 0) for a in AGENTS[:10]} == {0}
    for shards in (2, 3, 7, MAX_SHARDS):
        assert all(0 <= shard_of(a, shards) < shards for a in AGENTS)
    assert shard_of("", 2) == 0


@pytest.mark.parametrize(
    ("cores", "shards", "workers", "concurrency"), [(1, 1, 1, 8), (2, 1, 1, 8), (16, 7, 1, 2)]
)
def test_defaults_for_small_and_large_hosts(cores: int, shards: int, workers: int, concurrency: int) -> None:
    """1 or 2 cores: one shard (the single-process gateway) with one CPU worker and a pool's whole
    concurrency (8 here); 16 cores: 7 shards (one per two cores, one core for the front), each an event
    loop, one CPU worker and 8/7 of the pool's concurrency, rounded up."""
    assert default_shards(cores) == shards
    assert default_workers(cores, default_shards(cores)) == workers
    assert per_shard_concurrency(8, default_shards(cores)) == concurrency


def processes_busy(cores: int) -> int:
    """Cores the defaults keep busy: every shard's event loop and CPU workers, and the front when there is
    one (a single shard is the single-process gateway, no front)."""
    shards = default_shards(cores)
    front = 1 if shards > 1 else 0
    return shards * (1 + default_workers(cores, shards)) + front


def test_defaults_never_oversubscribe_16_cores() -> None:
    assert processes_busy(16) <= 16


def test_defaults_never_oversubscribe_any_host() -> None:
    """From 3 cores up: shards x (event loop + CPU workers) + the front fit the cores."""
    over = {c: processes_busy(c) for c in range(3, 257) if processes_busy(c) > c}
    assert not over, f"cores -> processes the defaults run: {over}"


def test_default_shards_is_capped() -> None:
    assert default_shards(10_000) == MAX_SHARDS
    assert default_shards(2 * MAX_SHARDS + 1) == MAX_SHARDS


@pytest.mark.parametrize(
    ("concurrency", "shards", "each"),
    [(8, 1, 8), (8, 2, 4), (7, 2, 4), (16, 7, 3), (1, 7, 1), (0, 2, 1), (5, 0, 5)],
)
def test_per_shard_concurrency(concurrency: int, shards: int, each: int) -> None:
    """Each shard's share of a pool's concurrency, rounded up, at least one."""
    assert per_shard_concurrency(concurrency, shards) == each


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("concurrency", [1, 2, 5, 16, 33, 100])
def test_per_shard_concurrency_adds_up_to_about_the_whole(concurrency: int, shards: int) -> None:
    """All shards together keep a remote server at least as busy as one process, at most shards - 1 more."""
    total = shards * per_shard_concurrency(concurrency, shards)
    assert concurrency <= total <= max(concurrency + shards - 1, shards)


def test_restart_delay_backs_off_and_resets() -> None:
    """0.5 s first, doubling up to 10 s for a shard that keeps dying; back to 0.5 s once one ran a minute."""
    delays = []
    previous = 0.0
    for _ in range(8):
        previous = restart_delay(previous, ran_s=1.0)
        delays.append(previous)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert FIRST_DELAY_S == 0.5 and MAX_DELAY_S == 10.0
    assert restart_delay(MAX_DELAY_S, ran_s=STEADY_S) == FIRST_DELAY_S
    assert restart_delay(4.0, ran_s=STEADY_S - 0.1) == 8.0
    assert restart_delay(0.0, ran_s=0.0) == FIRST_DELAY_S
