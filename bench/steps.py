"""The gateway loop thread's CPU per request, per step, from stack samples (issue 24).

A :class:`StackSampler` runs py-spy against this process while the run goes on and keeps the sampled
thread's busy stacks (py-spy leaves out samples where the thread waits in a system call: the loop's epoll
wait). Each sample is then given to ONE step: walking from the innermost frame outwards, the first frame
that a rule of :data:`RULES` matches (rules in order; a rule is a step and a predicate on the frame's file
name and function name) names the step, so ``prometheus_client`` called inside the backend call counts as
metrics, and a helper of a pipeline that no rule names counts where its caller does. A busy sample whose
innermost Python frame is the event loop's runner is uvloop's own C work between callbacks (reading the
sockets, scheduling); a stack no rule matches is "event loop & other". :func:`table` prints each step's
share of the busy samples and that share of the thread's measured CPU per request, in microseconds.

Caveats: C code (numpy, upb, libzmq, zstd) counts in the Python frame that called it, as it should; the
shares are of samples, so a step under ~1% is within the sampling noise of a few thousand samples.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

Predicate = Callable[[str, str], bool]
Frame = tuple[str, str]  # (file name, function name)

RECEIVE = "receive & decode"
SCREENING = "screening"
ROUTING = "routing"
QUEUEING = "queueing & work items"
PREPARE_RANKING = "CPU stage prepare: ranking"
PREPARE_TEXT = "CPU stage prepare: text"
PREPARE_OTHER = "CPU stage prepare: other"
BACKEND = "backend call"
FINISH_RANKING = "CPU stage finish: ranking"
FINISH_TEXT = "CPU stage finish: text"
FINISH_OTHER = "CPU stage finish: other"
ANSWERS = "answers"
SEND = "replies & send"
METRICS = "metrics"
LOOP = "event loop & kernel (C under the loop)"
OTHER = "other Python"

STEPS: tuple[str, ...] = (
    RECEIVE,
    SCREENING,
    ROUTING,
    QUEUEING,
    PREPARE_RANKING,
    PREPARE_TEXT,
    PREPARE_OTHER,
    BACKEND,
    FINISH_RANKING,
    FINISH_TEXT,
    FINISH_OTHER,
    ANSWERS,
    SEND,
    METRICS,
    LOOP,
    OTHER,
)
"""The steps in the order a request meets them: the table's rows."""

RUNNER: tuple[str, ...] = ("/asyncio/runners.py", "/uvloop/__init__.py")
"""Files whose frame is innermost only while the loop runs in C (or waits, which py-spy leaves out)."""


def at(path: str, *functions: str) -> Predicate:
    """Frames of ``path`` (a file, ``gateway/ingest.py``, or a folder, ``routing/``), of ``functions`` only
    when any are named."""
    names = frozenset(functions)
    if path.endswith("/"):

        def matches(filename: str, function: str) -> bool:
            return f"/{path}" in filename and (not names or function in names)

    else:

        def matches(filename: str, function: str) -> bool:
            return filename.endswith(f"/{path}") and (not names or function in names)

    return matches


def named(path: str, prefix: str) -> Predicate:
    """Frames of the files under folder ``path`` whose function name starts with ``prefix``."""

    def matches(filename: str, function: str) -> bool:
        return f"/{path}" in filename and function.startswith(prefix)

    return matches


RULES: tuple[tuple[str, Predicate], ...] = (
    # Counted wherever they are called from (innermost match): a counter inside the backend call is metrics.
    (METRICS, at("prometheus_client/")),
    (METRICS, at("gateway/ops/")),
    # Sending (Acks, answers, control) and what a send asks of the socket.
    (SEND, at("gateway/replies.py")),
    (SEND, at("gateway/ingress/carrier.py", "send", "send_to_peer")),
    (SEND, at("edgewire/parts.py", "send_parts")),
    (SEND, at("gateway/ingress/reader.py", "after_send")),
    (SEND, at("gateway/ingest.py", "_send", "flush_replies")),
    (SEND, at("edgewire/codec.py", "encode", "_compressed", "_compressor", "reframe")),
    (SEND, at("edgewire/codec.py", "repeated_field", "_varint")),
    # Answers: the response bytes, dedupe marked done, the response cache.
    (ANSWERS, at("gateway/frames/answers.py")),
    (ANSWERS, at("gateway/ingest.py", "respond_ok", "respond", "hand_back", "reroute")),
    (ANSWERS, at("gateway/dispatch/pool.py", "_answer", "_answer_status", "_status", "_fail")),
    (ANSWERS, at("gateway/dedupe.py", "done", "done_many", "put", "put_many", "get")),
    # The backend call.
    (BACKEND, at("gateway/dispatch/pool.py", "_call_backend", "_reject_inputs", "_succeeded")),
    (BACKEND, at("gateway/backends/")),
    (BACKEND, at("inference/backends/base.py")),
    # The CPU stage, per pipeline kind: a pipeline's helpers count where its entry points call them.
    (PREPARE_RANKING, at("inference/pipeline/ranking.py", "prepare", "prepare_views", "prepare_batch")),
    (PREPARE_RANKING, at("inference/pipeline/ranking.py", "prepare_alone", "ranking_columns")),
    (FINISH_RANKING, at("inference/pipeline/ranking.py", "finish", "finish_bytes", "ranked")),
    (FINISH_RANKING, at("inference/pipeline/ranking.py", "top_k_order", "top_k_orders")),
    (FINISH_RANKING, at("inference/pipeline/ranking.py", "top_k_orders_sorted")),
    (PREPARE_TEXT, at("inference/pipeline/text.py", "prepare", "tokenize", "_tokens_of", "tokens", "encode")),
    (PREPARE_TEXT, at("inference/pipeline/tokenizer.py")),
    (FINISH_TEXT, at("inference/pipeline/text.py", "finish", "finish_bytes", "normalised_embeddings")),
    (PREPARE_OTHER, at("gateway/dispatch/cpu.py", "prepare")),
    (PREPARE_OTHER, named("inference/pipeline/", "prepare")),
    (FINISH_OTHER, at("gateway/dispatch/cpu.py", "finish")),
    (FINISH_OTHER, named("inference/pipeline/", "finish")),
    (FINISH_OTHER, at("inference/pipeline/worker.py", "without_inputs")),
    # Screening: ids, duplicates, model, limits, deadline, drain.
    (SCREENING, at("gateway/ingest.py", "_screen_frame", "_duplicate", "_nack", "_ask_on", "_redeliver")),
    (SCREENING, at("gateway/dedupe.py", "state", "_expire", "forget")),
    (SCREENING, at("edgewire/ids.py")),
    (SCREENING, at("inference/profile.py", "wire_priority")),
    # Routing: the request's profile, the policy's decision, the pools' signals it reads, its estimates.
    (ROUTING, at("gateway/ingest.py", "_route", "__getitem__", "__iter__", "__len__")),
    (ROUTING, at("gateway/dispatch/pool.py", "signals", "signals_for", "healthy", "depth")),
    (ROUTING, at("gateway/server.py", "_observe_latency")),
    (ROUTING, at("gateway/frames/route.py")),
    (ROUTING, at("gateway/frames/groups.py")),
    (ROUTING, at("inference/profile.py")),
    (ROUTING, at("inference/pipeline/textsize.py")),
    (RECEIVE, at("routing/regions.py")),  # the agent's region, as the frame is identified
    (ROUTING, at("routing/")),
    # Queueing: work items, the Ack's accepted ids, the pools' queues, batches cut and served.
    (QUEUEING, at("gateway/ingest.py", "_items", "_accepted")),
    (QUEUEING, at("gateway/dedupe.py", "accept", "accept_many")),
    (QUEUEING, at("gateway/dispatch/cpu.py", "release")),
    (QUEUEING, at("gateway/dispatch/pool.py")),
    (QUEUEING, at("gateway/dispatch/eager.py")),
    (QUEUEING, at("gateway/dispatch/work.py")),
    (QUEUEING, at("gateway/dispatch/breaker.py")),
    (QUEUEING, at("gateway/dispatch/batch_limits.py")),
    # Receiving: the reader, the budget, the envelope and payload decoded, the requests' spans found.
    (RECEIVE, at("gateway/ingress/")),
    (RECEIVE, at("gateway/ingest.py")),
    (RECEIVE, at("edgewire/codec.py")),
    (RECEIVE, at("edgewire/scan.py")),
    (RECEIVE, at("gateway/frames/wire.py")),
)
"""(step, predicate), in order: a frame belongs to the first rule that matches it."""


def step_of_frame(frame: Frame, rules: Sequence[tuple[str, Predicate]] = RULES) -> str | None:
    """The step of the first rule matching ``frame``; None when none does."""
    filename, function = frame
    for step, matches in rules:
        if matches(filename, function):
            return step
    return None


def attribute(stack: Sequence[Frame], rules: Sequence[tuple[str, Predicate]] = RULES) -> str:
    """The step of a busy sample: ``stack`` innermost frame first. :data:`LOOP` when the innermost frame is
    the loop's runner: C under it, uvloop's own and the kernel's (epoll, the send's wake-up of ZeroMQ's
    I/O thread, a futex when the GIL changes threads), which perf tells apart and py-spy cannot; else the
    step of the innermost frame a rule matches; else :data:`OTHER`."""
    if not stack or stack[0][0].endswith(RUNNER):
        return LOOP
    for frame in stack:
        step = step_of_frame(frame, rules)
        if step is not None:
            return step
    return OTHER


class StackSampler:
    """Samples one thread's Python stacks (``native_id``: its ``threading.get_native_id()``) with py-spy,
    from outside the interpreter, so the sampled thread does not decide when a sample lands (a sampler
    thread of our own gets the GIL only where the sampled one lets it go, and so sees mostly I/O calls).
    About ``rate`` samples a second; samples where the thread is idle (in a blocking system call) are left
    out. ``blocking`` (the default) pauses the process for each sample, so each stack is consistent; that
    slows the sampled run a lot (its CPU per request is printed beside the unsampled one) but spreads the
    cost over whatever it interrupts; ``blocking=False`` reads the stacks while the process runs (cheaper,
    torn stacks). A context manager: py-spy attaches on entry and its stacks are read on exit, into
    ``stacks`` (frames innermost first, each (file name, function name)) and ``taken``."""

    def __init__(
        self, native_id: int, rate: int = 1000, pid: int | None = None, blocking: bool = True
    ) -> None:
        self.stacks: Counter[tuple[Frame, ...]] = Counter()
        self.taken = 0
        self._thread = f"thread ({native_id})"  # as py-spy names it: the OS thread id (get_native_id)
        self._rate = rate
        self._blocking = blocking  # py-spy pauses the process for each sample: consistent stacks
        self._pid = os.getpid() if pid is None else pid
        self._out = Path(tempfile.mkdtemp(prefix="steps-")) / "stacks.txt"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> StackSampler:
        spy = Path(sys.executable).with_name("py-spy")
        command = [str(spy if spy.exists() else "py-spy"), "record", "--pid", str(self._pid)]
        command += ["--rate", str(self._rate), "--format", "raw", "--output", str(self._out)]
        command += ["--threads", "--full-filenames", "--nolineno"]
        if not self._blocking:
            command.append("--nonblocking")
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self._proc.stdout is not None
        # py-spy says it samples once it has attached (its first line); when it cannot, it exits (EOF).
        started = self._proc.stdout.readline()
        if not started.startswith(b"py-spy> Sampling"):
            _, err = self._proc.communicate(timeout=30)
            raise RuntimeError(f"py-spy did not start: {(started + err).decode(errors='replace')}")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        try:
            self._proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.communicate()
        if self._out.exists():
            self._read(self._out.read_text())
            self._out.unlink()
        self._out.parent.rmdir()

    def _read(self, text: str) -> None:
        for line in text.splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            if not count.isdigit() or not frames or not frames[0].startswith(self._thread):
                continue
            parsed: list[Frame] = []
            for frame in reversed(frames[1:]):  # py-spy writes outermost first
                function, _, where = frame.partition(" (")
                # py-spy names a method Class.method: the rules name functions as code objects do.
                parsed.append((where.rstrip(")"), function.rpartition(".")[2]))
            self.stacks[tuple(parsed)] += int(count)
            self.taken += int(count)


def per_step(stacks: Mapping[tuple[Frame, ...], int]) -> dict[str, Counter[Frame]]:
    """Per step, the samples counted by their innermost frame."""
    steps: dict[str, Counter[Frame]] = {}
    for stack in stacks:
        n = stacks[stack]
        inner = steps.setdefault(attribute(stack), Counter())
        inner[stack[0] if stack else ("", "")] += n
    return steps


def _where(frame: Frame) -> str:
    filename, function = frame
    return f"{filename.rsplit('/', 1)[-1]}:{function}"


def table(
    steps: Mapping[str, Counter[Frame]], cpu_us: float, order: Iterable[str] = STEPS, detail: int = 0
) -> str:
    """Per step: busy samples, their share, that share of ``cpu_us`` (the thread's CPU per request), and
    the innermost frame its samples are most often in (with ``detail``, that many such frames each, in
    microseconds per request, on lines of their own); then the total."""
    busy = sum(sum(c.values()) for c in steps.values())
    rows = [f"{'step':<28} {'samples':>8} {'share':>7} {'us/request':>11}  most samples in (share of step)"]
    for step in order:
        frames = steps.get(step)
        n = sum(frames.values()) if frames else 0
        if not frames or not n:
            continue
        share = n / busy
        top, top_n = frames.most_common(1)[0]
        rows.append(
            f"{step:<28} {n:>8} {share:>7.1%} {share * cpu_us:>11.1f}  {_where(top)} ({top_n / n:.0%})"
        )
        for frame, k in frames.most_common(detail)[1 if detail else 0 :]:
            rows.append(f"{'':<46} {k / busy * cpu_us:>8.1f}  {_where(frame)}")
    rows.append(f"{'total':<28} {busy:>8} {1 if busy else 0:>7.1%} {cpu_us if busy else 0.0:>11.1f}")
    return "\n".join(rows)
