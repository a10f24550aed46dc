"""Shared memory between the gateway and its CPU workers, so batches never travel through a pipe.

A prepared ranking batch is about a megabyte of float32 features, its requests a few hundred kilobytes.
Through Python's process pool each is pickled, written through a 64 KiB pipe in dozens of pieces (each a
wake-up of the other process), read and unpickled: four copies and the GIL held for the pickling, about
a quarter of the gateway's time under the ingest benchmark. Instead the gateway owns one shared memory
block cut into equal slots. A batch borrows a slot; the gateway puts the serialized requests at its
start, the worker parses them there and copies the input tensors it builds after them; the gateway hands
numpy views of those to the backend and gives the slot back when the backend call is over.

Bounded: a fixed number of slots of a fixed size. A batch that finds no free slot, or whose tensors do not
fit in one, travels the ordinary way (counted in ``hkgw_cpu_arena_fallbacks_total``).

Left behind: a gateway killed with SIGKILL (its resource tracker with it, as systemd kills a whole unit)
cannot unlink its block, and /dev/shm would keep it until reboot. So a block is named
``hkgw-arena-<pid>-<n>`` and its owner holds an exclusive ``flock`` on it from before it has a size until
it is unlinked; the kernel drops the lock when the owner dies, however it dies. A starting CPU stage removes
the blocks of that prefix that have a size and whose lock nobody holds (:func:`remove_leftover_arenas`, a
bounded look at /dev/shm) before it measures the room there. The lock, not the pid, says whether the owner
lives: a pid may be reused, or belong to another pid namespace.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import structlog

ALIGN = 64  # every tensor starts on a cache line
SHM_DIR = "/dev/shm"  # noqa: S108  (where Linux keeps POSIX shared memory; the names are the gateway's own)
Placed = dict[str, tuple[int, str, tuple[int, ...]]]
"""Input name -> (byte offset in the arena, numpy dtype string, shape)."""
ARENA_PREFIX = "hkgw-arena-"
"""The gateway's blocks are ``hkgw-arena-<owner pid>-<n>``: the only names it ever removes."""
LEFTOVER_SCAN_MAX = 4096
"""Entries of /dev/shm looked at when an arena starts: a bound on that work, whatever else is there."""

log = structlog.get_logger("inference.arena")
_numbers = itertools.count()


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a worker may write one batch's tensors: picklable, sent with the batch."""

    arena: str  # the shared memory block's name (a file under /dev/shm on Linux)
    index: int
    offset: int
    size: int


class FeatureArena:
    """The gateway's side: owns the block, lends slots, makes views of what workers placed."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes - slot_bytes % ALIGN
        shm, self._lock = _create_block(slots * self.slot_bytes)
        self._shm: shared_memory.SharedMemory | None = shm
        self.name = shm.name
        self._free = list(range(slots - 1, -1, -1))  # lowest index lent first: untouched slots stay unmapped
        self.slots = slots

    @property
    def free(self) -> int:
        return len(self._free)

    def borrow(self) -> Slot | None:
        if not self._free:
            return None
        index = self._free.pop()
        return Slot(self.name, index, index * self.slot_bytes, self.slot_bytes)

    def give_back(self, slot: Slot) -> None:
        self._free.append(slot.index)
        self._free.sort(reverse=True)

    def put_payloads(self, slot: Slot, payloads: Sequence[bytes | memoryview]) -> tuple[int, ...] | None:
        """Copy a batch's serialized requests to the start of ``slot`` for the worker to read; their
        lengths, or None when they would take more than half the slot (they then travel by pipe)."""
        lengths = tuple(map(len, payloads))
        if sum(lengths) > slot.size // 2:
            return None
        assert self._shm is not None
        assert self._shm.buf is not None
        buf = self._shm.buf
        cursor = slot.offset
        for payload, n in zip(payloads, lengths, strict=True):
            buf[cursor : cursor + n] = payload
            cursor += n
        return lengths

    def views(self, placed: Placed) -> dict[str, np.ndarray]:
        """Arrays over the slot's bytes; valid until the slot is given back."""
        assert self._shm is not None
        assert self._shm.buf is not None
        buf = self._shm.buf
        return {
            name: np.ndarray(shape, dtype=np.dtype(dtype), buffer=buf, offset=offset)
            for name, (offset, dtype, shape) in placed.items()
        }

    def close(self) -> None:
        """Unmap and remove the block (views must be gone). Safe twice."""
        shm, self._shm = self._shm, None
        if shm is None:
            return
        with contextlib.suppress(BufferError):  # a view still exists: the mapping stays, the name goes
            shm.close()
        try:
            shm.unlink()
        finally:
            os.close(self._lock)  # after the unlink: a live block is never seen unlocked


def _create_block(size: int) -> tuple[shared_memory.SharedMemory, int]:
    """A new block named for this process, and the descriptor that holds its owner's lock."""
    for _ in range(64):  # a name still taken (a locked block of another pid namespace): the next number
        name = f"{ARENA_PREFIX}{os.getpid()}-{next(_numbers)}"
        path = Path(SHM_DIR) / name
        try:
            lock = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        try:
            # Locked while still empty: remove_leftover_arenas passes over empty blocks, so it never sees
            # this one unlocked.
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(lock, size)
            return shared_memory.SharedMemory(name=name), lock
        except BaseException:
            os.close(lock)
            path.unlink()
            raise
    raise FileExistsError(f"every {ARENA_PREFIX}{os.getpid()}-<n> name tried is taken in {SHM_DIR}")


def remove_leftover_arenas() -> list[str]:
    """Unlink the gateway blocks in /dev/shm whose owner is gone: a size, and nobody holds their lock.
    Returns the names removed, each logged. At most ``LEFTOVER_SCAN_MAX`` entries are looked at; names
    without ``ARENA_PREFIX`` are never touched."""
    removed: list[str] = []
    try:
        entries = os.scandir(SHM_DIR)
    except OSError:
        return removed
    with entries:
        for entry in itertools.islice(entries, LEFTOVER_SCAN_MAX):
            if not entry.name.startswith(ARENA_PREFIX):
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
                if not size or not _unlocked(entry.path):
                    continue
                os.unlink(entry.path)
            except FileNotFoundError:  # another gateway starting removed it first
                continue
            except OSError as exc:  # e.g. another user's block: /dev/shm is sticky, and it is mode 0600
                log.warning("cannot check or remove a CPU arena block", name=entry.name, error=str(exc))
                continue
            removed.append(entry.name)
            log.warning("removed a CPU arena its gateway left", name=entry.name, bytes=size)
    return removed


def _unlocked(path: str) -> bool:
    """Nobody holds the block's owner lock (taken for a moment to find out)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm (a container's is often only 64 MiB), or None where there is none."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


_MAPPED: dict[str, mmap.mmap] = {}


def payloads_in(slot: Slot, lengths: Sequence[int]) -> list[memoryview]:
    """Worker side: the serialized requests the gateway put at the start of ``slot`` (views, no copy)."""
    block = memoryview(_mapped(slot.arena))
    out = []
    cursor = slot.offset
    for n in lengths:
        out.append(block[cursor : cursor + n])
        cursor += n
    return out


def place(slot: Slot, inputs: Mapping[str, np.ndarray], start: int = 0) -> Placed | None:
    """Worker side: copy ``inputs`` into ``slot`` from byte ``start`` of it on; None (nothing written) when
    they do not fit."""
    layout: Placed = {}
    cursor = slot.offset + start
    end = slot.offset + slot.size
    for name, array in inputs.items():
        start = -(-cursor // ALIGN) * ALIGN
        if start + array.nbytes > end or array.dtype.hasobject:
            return None
        layout[name] = (start, array.dtype.str, tuple(array.shape))
        cursor = start + array.nbytes
    block = _mapped(slot.arena)
    for name, array in inputs.items():
        offset, dtype, shape = layout[name]
        np.ndarray(shape, dtype=np.dtype(dtype), buffer=block, offset=offset)[...] = array
    return layout


def _mapped(name: str) -> mmap.mmap:
    """The arena mapped into this worker, once. Opened as a file, not as SharedMemory: a worker that
    attached through SharedMemory would register it with the resource tracker, which then removes it (and
    warns) when the worker exits, under the gateway's feet."""
    block = _MAPPED.get(name)
    if block is None:
        if len(_MAPPED) >= 4:  # a replaced gateway arena; the old one is not written to any more
            for old in _MAPPED.values():
                old.close()
            _MAPPED.clear()
        with open(Path(SHM_DIR) / name.lstrip("/"), "r+b") as f:
            block = _MAPPED[name] = mmap.mmap(f.fileno(), 0)
    return block
