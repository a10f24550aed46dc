"""A process that appends to and acks a Spool until killed; the kill -9 test's victim.

Run as ``python -m tests.edge_agent.spool_writer DIRECTORY``. It follows ``plan()`` and prints the index of
each operation after the Spool call returns (flushed), so the test knows what was confirmed before the kill.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from edge_agent.spool import AppendResult, Spool

SEGMENT_BYTES = 16 * 1024
MAX_OPS = 200_000  # an orphaned writer stops on its own


def request_id(n: int) -> bytes:
    """The 16-byte id of the writer's n-th request."""
    return n.to_bytes(16, "big")


def payload_for(n: int) -> bytes:
    """The deterministic payload of the writer's n-th request (100 to 2099 bytes)."""
    return random.Random(n).randbytes(100 + (n * 37) % 2000)


def plan() -> Iterator[tuple[Literal["put", "ack"], list[int]]]:
    """The writer's operations: a put per request, and every fourth put an out-of-order ack of two."""
    n = 0
    while True:
        yield "put", [n]
        if n % 4 == 3:
            yield "ack", [n - 1, n - 3]
        n += 1


def main(directory: Path) -> int:
    """Follow ``plan()`` with fsync="always", printing each operation's index once it returned."""
    with Spool(directory, segment_bytes=SEGMENT_BYTES, max_bytes=1 << 40, fsync="always") as spool:
        for index, (op, numbers) in enumerate(plan()):
            if index >= MAX_OPS:
                break
            if op == "put":
                result = spool.append(request_id(numbers[0]), payload_for(numbers[0]))
                if result is not AppendResult.STORED:
                    return 1
            else:
                spool.ack([request_id(n) for n in numbers])
            print(index, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
