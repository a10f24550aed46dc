"""bench/steps.py: samples go to the step of their innermost known frame; py-spy's raw output is read for
the sampled thread only; and a real py-spy run on a busy thread finds it."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from bench.steps import (
    BACKEND,
    LOOP,
    METRICS,
    OTHER,
    PREPARE_RANKING,
    SEND,
    StackSampler,
    attribute,
    per_step,
    table,
)

RUNNER = ("/usr/lib/python3.11/asyncio/runners.py", "run")
CALL = ("/src/gateway/dispatch/pool.py", "_call_backend")
INC = ("/venv/site-packages/prometheus_client/values.py", "inc")
PREPARE = ("/src/inference/pipeline/ranking.py", "prepare_alone")
NUMPY = ("/venv/site-packages/numpy/core/fromnumeric.py", "_wrapfunc")


def test_the_innermost_frame_a_rule_knows_names_the_step() -> None:
    assert attribute([INC, CALL, RUNNER]) == METRICS  # a counter inside the backend call is metrics
    assert attribute([CALL, RUNNER]) == BACKEND
    assert attribute([NUMPY, PREPARE, RUNNER]) == PREPARE_RANKING  # numpy counts where it was called
    assert attribute([("/src/edgewire/parts.py", "send_parts"), RUNNER]) == SEND
    assert attribute([RUNNER]) == LOOP  # busy, no Python frame of ours: C under the loop
    assert attribute([("/elsewhere.py", "f"), RUNNER]) == OTHER


def test_py_spy_raw_lines_of_the_sampled_thread_are_read_innermost_first() -> None:
    sampler = StackSampler(4242)
    sampler._read(
        "thread (4242): MainThread;run (/usr/lib/python3.11/asyncio/runners.py);"
        "PoolDispatcher._call_backend (/src/gateway/dispatch/pool.py) 7\n"
        "thread (999): other;busy (/x.py) 5\n"
        "garbage line\n"
    )
    assert sampler.taken == 7
    assert sampler.stacks == Counter({(CALL, RUNNER): 7})  # Class.method read as the code's name
    steps = per_step(sampler.stacks)
    assert steps == {BACKEND: Counter({CALL: 7})}
    assert "backend call" in table(steps, 100.0) and "100.0" in table(steps, 100.0)


def busy(rounds: int) -> int:
    n = 0
    for _ in range(rounds):
        n += 1
    return n


def test_py_spy_samples_a_busy_thread_of_this_process() -> None:
    """A real py-spy attached to this process sees the thread spin in ``busy`` (a fixed amount of work,
    done while py-spy is attached: the sampler is entered before the work starts and left after it ends)."""
    attached, finished = threading.Event(), threading.Event()

    def spin() -> None:
        attached.wait(30)
        busy(20_000_000)  # ~1 s of one core here: some hundreds of samples at 200 a second
        finished.set()

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        with StackSampler(thread.native_id or 0, rate=200) as sampler:
            attached.set()
            assert finished.wait(120), "the busy thread did not finish its work"
    except RuntimeError as exc:  # a container without CAP_SYS_PTRACE: py-spy cannot read this process
        if "ermission" not in str(exc):
            raise
        pytest.skip(f"py-spy may not attach here: {exc}")
    finally:
        attached.set()
        thread.join(120)
    assert sampler.taken > 10
    innermost = Counter(stack[0][1] for stack in sampler.stacks.elements() if stack)
    assert innermost.most_common(1)[0][0] == "busy", innermost
