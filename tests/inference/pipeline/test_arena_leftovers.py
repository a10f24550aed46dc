"""Shared memory a killed gateway left in /dev/shm is removed when the next CPU stage starts; only that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.dispatch import cpu as cpu_module
from gateway.dispatch.cpu import CpuStage
from gateway.ops.metrics import GatewayMetrics
from inference.pipeline.arena import ARENA_PREFIX, SHM_DIR, FeatureArena, remove_leftover_arenas

ROOT = Path(__file__).resolve().parents[3]
OWNER = """
import sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout carries the name
from inference.pipeline.arena import FeatureArena
arena = FeatureArena(2, 4096)
print(arena.name, flush=True)
sys.stdin.read()
arena.close()
"""
"""A process owning an arena until its stdin closes (a gateway's CPU stage, reduced to its arena)."""


def start_owner() -> tuple[subprocess.Popen[str], Path]:
    """An owner in a session of its own (its resource tracker in its process group); its block's path."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert owner.stdout is not None
    name = owner.stdout.readline().strip()
    assert name, "the owner printed no arena name"
    return owner, Path(SHM_DIR) / name


@pytest.fixture
def shm_files() -> Iterator[list[Path]]:
    """Paths under /dev/shm a test made; removed afterwards if still there."""
    made: list[Path] = []
    yield made
    for path in made:
        path.unlink(missing_ok=True)


async def test_a_killed_owners_block_is_removed_and_a_live_ones_kept(
    shm_files: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner killed with SIGKILL together with its resource tracker (as systemd kills a unit) leaves its
    block behind; the next CPU stage to start removes it before it measures the room in /dev/shm (which
    the block would take), and keeps the block of an owner still running."""
    killed, killed_block = start_owner()
    live, live_block = start_owner()
    shm_files += [killed_block, live_block]
    measured_with: list[bool] = []

    def free_bytes() -> int:
        measured_with.append(killed_block.exists())
        return 1 << 30

    monkeypatch.setattr(cpu_module, "shm_free_bytes", free_bytes)
    try:
        assert killed_block.name.startswith(f"{ARENA_PREFIX}{killed.pid}-")
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed_block.exists()  # left behind: nothing of the owner ran after the kill
        stage = CpuStage(1, "process", GatewayMetrics(()), arena_slots=2, arena_slot_bytes=4096)
        stage.start()
        try:
            assert measured_with == [False]
            assert not killed_block.exists()
            assert live_block.exists()
            assert stage.arena is not None and (Path(SHM_DIR) / stage.arena.name).exists()
        finally:
            stage.close()
    finally:
        assert live.stdin is not None
        live.stdin.close()
        assert live.wait(timeout=30) == 0
    assert not live_block.exists()  # its owner removed it on close


def test_only_unlocked_blocks_of_the_prefix_with_a_size_are_removed(shm_files: list[Path]) -> None:
    """A block named for a pid that is gone, unlocked, is removed; a live arena of this very process (its
    lock held on another descriptor), an empty block of the prefix (one being made is locked before it gets
    a size), a symlink of the prefix (not followed) and other names are kept."""
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    tag = uuid.uuid4().hex[:8]
    stale = Path(SHM_DIR) / f"{ARENA_PREFIX}{int(finished.stdout)}-{tag}"
    empty = Path(SHM_DIR) / f"{ARENA_PREFIX}{int(finished.stdout)}-{tag}-empty"
    foreign = Path(SHM_DIR) / f"psm_hkgw_test_{tag}"
    link = Path(SHM_DIR) / f"{ARENA_PREFIX}{int(finished.stdout)}-{tag}-link"
    shm_files += [stale, empty, foreign, link]
    stale.write_bytes(b"\0" * 4096)
    empty.write_bytes(b"")
    foreign.write_bytes(b"\0" * 4096)
    link.symlink_to(foreign)
    arena = FeatureArena(2, 4096)
    try:
        removed = remove_leftover_arenas()  # a gateway starting elsewhere on this host may beat it to one
        assert not stale.exists()
        assert {empty.name, foreign.name, link.name, arena.name}.isdisjoint(removed)
        assert empty.exists() and foreign.exists() and (Path(SHM_DIR) / arena.name).exists()
        assert link.is_symlink()  # never followed: an error for that entry, logged, and the scan goes on
    finally:
        arena.close()
    assert not (Path(SHM_DIR) / arena.name).exists()
