"""Which shard serves an agent, and how many shards and CPU workers a host gets by default. Pure."""

from __future__ import annotations

import math
import os
import zlib

MAX_SHARDS = 64


def cores() -> int:
    """The cores this process may run on (its CPU affinity, as systemd's CPUAffinity= or taskset set it)."""
    return len(os.sched_getaffinity(0))


def shard_of(agent_id: str, shards: int) -> int:
    """Every frame of one agent, on any carrier, goes to the same shard: crc32 of its id modulo the count.

    Stable across restarts of any process (no per-process hash seed) and the same on every host."""
    return zlib.crc32(agent_id.encode()) % shards if shards > 1 else 0


def default_shards(available: int) -> int:
    """One shard per two cores, less one core for the front: a shard's event loop takes one core and its
    CPU worker the other. 1 or 2 cores give one shard, which is the single-process gateway."""
    return max(1, min(MAX_SHARDS, (available - 1) // 2))


def default_workers(available: int, shards: int) -> int:
    """CPU-stage workers per shard: the cores left to a shard after its event loop (and, with shards, after
    the front's core), at least one."""
    shards = max(1, shards)
    return max(1, (available - (1 if shards > 1 else 0)) // shards - 1)


def per_shard_concurrency(concurrency: int, shards: int) -> int:
    """A pool's ``concurrency`` is the whole gateway's: each shard gets its share, rounded up, so that all
    shards together keep a remote server about as busy as one process would (at most shards - 1 more)."""
    return max(1, math.ceil(concurrency / max(1, shards)))
