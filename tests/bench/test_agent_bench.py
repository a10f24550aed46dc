"""bench/agent_bench.py's accounting: a thread's own CPU from /proc, and the agent's loop samples grouped by
the task they ran in (the first edge_agent frame under the loop's runner, not the module that started it)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

from bench.agent_bench import agent_tasks, thread_cpu
from bench.steps import Frame

MAIN = ("/src/edge_agent/__main__.py", "<module>")
RUN = ("/src/edge_agent/cli.py", "_run")
RUNNER = ("/usr/lib/python3.11/asyncio/runners.py", "run")
SENDER = ("/src/edge_agent/uplink/link.py", "_sender")
SEND_BATCH = ("/src/edge_agent/uplink/link.py", "_send_batch")
COMPRESS = ("/src/edgewire/codec.py", "_compressed")
READ = ("/src/edge_agent/intake.py", "_read")
ZMQ_SEND = ("/venv/site-packages/zmq/sugar/socket.py", "send")


def test_agent_samples_go_to_the_task_under_the_loop_runner() -> None:
    stacks: Counter[tuple[Frame, ...]] = Counter(
        {
            # innermost first, as StackSampler keeps them
            (COMPRESS, SEND_BATCH, SENDER, RUNNER, RUN, MAIN): 5,
            (ZMQ_SEND, SEND_BATCH, SENDER, RUNNER, RUN, MAIN): 2,
            (READ, RUNNER, RUN, MAIN): 3,
            (RUNNER, RUN, MAIN): 1,  # C under the loop: no task of the agent's
        }
    )
    tasks = agent_tasks(stacks)
    assert set(tasks) == {"uplink/link.py:_sender", "intake.py:_read", "event loop & other"}
    assert tasks["uplink/link.py:_sender"] == Counter({COMPRESS: 5, ZMQ_SEND: 2})
    assert tasks["intake.py:_read"] == Counter({READ: 3})
    assert sum(tasks["event loop & other"].values()) == 1


def test_thread_cpu_is_that_thread_alone() -> None:
    """A thread's CPU grows with its own work and not with another thread's."""
    pid, me = os.getpid(), threading.get_native_id()
    other: list[int] = []
    started = threading.Event()
    done = threading.Event()

    def idle() -> None:
        other.append(threading.get_native_id())
        started.set()
        done.wait(30)

    thread = threading.Thread(target=idle)
    thread.start()
    started.wait(30)
    try:
        mine, theirs = thread_cpu(pid, me), thread_cpu(pid, other[0])
        end = time.thread_time() + 0.3
        while time.thread_time() < end:  # 0.3 s of this thread's CPU
            pass
        assert thread_cpu(pid, me) - mine >= 0.2
        assert thread_cpu(pid, other[0]) - theirs < 0.1
    finally:
        done.set()
        thread.join(30)
    assert thread_cpu(pid, 1 << 30) == 0.0  # no such thread
