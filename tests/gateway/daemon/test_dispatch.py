"""Dedupe across carriers, overload shedding, deadlines, circuit breaker and spillover, on a real gateway."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgewire import now_unix_us, pb
from gateway.config import ConfigError, load_config
from gateway.dispatch.pool import PoolDispatcher
from gateway.dispatch.work import WorkItem
from gateway.server import Gateway
from gateway.testing import (
    FaultInjectingBackend,
    WireClient,
    fault_injecting_pools,
    fresh_requests,
    loopback_overrides,
    run_gateway,
    wait_for,
)
from inference.backends.base import InferCall, InferResult
from inference.pipeline.text import length_bucket
from inference.pipeline.textsize import estimated_tokens
from inference.profile import profile_of
from routing.types import Priority
from tests.gateway.daemon.test_serving import synthetic


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


def split_backends(
    models_dir: Path, *, queue_depth: int | None = None, concurrency: int | None = None, open_s: float = 0.5
) -> dict[str, Any]:
    """CPU pool on one real ONNX backend, every cloud pool on a fault-injecting wrapper of another."""
    overrides = fault_injecting_pools(
        {"type": "onnx", "repository": str(models_dir), "threads": 2},
        breaker={"failure_threshold": 2, "open_s": open_s},
    )
    for pool in overrides["routing"]["pools"]:
        if queue_depth is not None:
            pool["max_queue_depth"] = queue_depth
        if concurrency is not None:
            pool["concurrency"] = concurrency
    return overrides


def backend(gw: Gateway, name: str) -> FaultInjectingBackend:
    found = gw.backends[name]
    assert isinstance(found, FaultInjectingBackend)
    return found


async def test_resend_on_another_carrier_is_not_served_twice(models_dir: Path) -> None:
    """The same request ids resent on a second carrier are acked as duplicates and executed once."""
    async with run_gateway(models_dir=models_dir, **split_backends(models_dir)) as gw:
        slow = backend(gw, "embedded")
        slow.delay_s = 0.3  # keep the first copies in flight while the resend arrives
        requests = synthetic(12, seed=11)
        for r in requests:
            r.complexity_hint = 0.0
        async with (
            WireClient(gw.endpoint("hgc"), agent_id="a1") as first,
            WireClient(gw.endpoint("pccw"), agent_id="a1") as second,
        ):
            ack1 = await first.wait_ack(await first.send(requests))
            ack2 = await second.wait_ack(await second.send(requests))
            ids = [r.request_id for r in requests]
            received = {}
            deadline = time.monotonic() + 10
            while len(received) < len(ids) and time.monotonic() < deadline:
                for client in (first, second):
                    await client.receive_one(0.05)
                    received.update(client.responses)
        calls = slow.rows + backend(gw, "gpu").rows
    assert sorted(ack1.accepted_ids) == sorted(ids)
    assert sorted(ack2.duplicate_ids) == sorted(ids)
    assert not ack2.accepted_ids
    assert set(received) == set(ids)
    assert first.duplicate_responses == 0
    assert sample(gw, "hkgw_requests_duplicate_total", carrier="pccw") == len(ids)
    assert calls > 0


async def test_resend_after_answer_gets_the_cached_answer(models_dir: Path) -> None:
    """A resend of an already answered request is re-delivered from the response cache, not re-run."""
    async with run_gateway(models_dir=models_dir) as gw:
        requests = synthetic(5, seed=12)
        async with WireClient(gw.endpoint("hgc"), agent_id="a2") as first:
            original = await first.infer(requests)
        calls_before = sample(gw, "hkgw_backend_calls_total", backend="embedded", outcome="ok")
        async with WireClient(gw.endpoint("tgt"), agent_id="a2") as moved:
            again = await moved.infer(requests)
        calls_after = sample(gw, "hkgw_backend_calls_total", backend="embedded", outcome="ok")
    assert [r.SerializeToString() for r in again] == [r.SerializeToString() for r in original]
    assert calls_after == calls_before


class Peaks:
    """The largest queue depth and batches in flight any pool reached, recorded as they change (at every
    submit, at every backend call) rather than sampled."""

    def __init__(self, gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
        self.depth = self.inflight = self.calls = 0
        self._pools = list(gw.pools.values())
        for pool in self._pools:
            monkeypatch.setattr(pool, "submit_many", self._submit(pool))
        for name in ("embedded", "gpu"):
            wrapped = backend(gw, name)
            monkeypatch.setattr(wrapped, "infer", self._infer(wrapped))

    def _submit(self, pool: PoolDispatcher) -> Callable[[list[WorkItem], float], bool]:
        real = pool.submit_many

        def submit(items: list[WorkItem], now: float) -> bool:
            taken = real(items, now)
            self.depth = max(self.depth, pool.depth)
            return taken

        return submit

    def _infer(self, wrapped: FaultInjectingBackend) -> Callable[[InferCall], Awaitable[InferResult]]:
        real = wrapped.infer

        async def infer(call: InferCall) -> InferResult:
            # The calling batch is in flight in its pool: a pool over its concurrency shows here.
            self.calls += 1
            self.inflight = max(self.inflight, *(p.inflight for p in self._pools))
            return await real(call)

        return infer


async def test_flood_is_shed_with_overloaded_and_bounded_queues(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood beyond the pools' queues is nacked OVERLOADED with a retry-after; queues stay bounded and
    no pool has more batches at the backend than its concurrency. Every accepted request is answered: OK,
    or (a less urgent one whose place in a full queue a more urgent one took) OVERLOADED with a
    retry-after, counted as preempted."""
    async with run_gateway(
        models_dir=models_dir, **split_backends(models_dir, queue_depth=16, concurrency=1)
    ) as gw:
        for name in ("embedded", "gpu"):
            backend(gw, name).delay_s = 0.02
        peaks = Peaks(gw, monkeypatch)
        base = synthetic(100, seed=13)
        frames = [fresh_requests(base, budget_s=30) for _ in range(20)]
        async with WireClient(gw.endpoint("hgc")) as agent:
            message_ids = [await agent.send(frame) for frame in frames]
            acks = [await agent.wait_ack(m) for m in message_ids]
            accepted = [rid for ack in acks for rid in ack.accepted_ids]
            await agent.wait_responses(accepted, timeout_s=60)
        preempted_total = sum(sample(gw, "hkgw_shed_total", pool=p, reason="preempted") for p in gw.pools)
    nacks = [n for ack in acks for n in ack.nacks]
    assert len(accepted) + len(nacks) == 2000
    assert nacks
    assert all(n.reason == pb.NACK_REASON_OVERLOADED and n.retry_after_ms > 0 for n in nacks)
    assert peaks.calls > 0
    assert 0 < peaks.depth <= 16
    assert peaks.inflight == 1  # concurrency = 1: batches wait for the one at the backend
    priority = {r.request_id: r.priority for frame in frames for r in frame}
    preempted = [agent.responses[rid] for rid in accepted if agent.responses[rid].status != pb.STATUS_OK]
    assert len(preempted) == preempted_total
    assert all(
        r.status == pb.STATUS_OVERLOADED
        and r.retry_after_ms > 0
        and "for more urgent requests" in r.error_message
        and priority[r.request_id] != pb.PRIORITY_CLASS_REALTIME
        for r in preempted
    )


async def test_deadline_passing_in_queue_is_answered_deadline_exceeded(models_dir: Path) -> None:
    """Requests whose deadline passes while they wait are answered DEADLINE_EXCEEDED, never late and OK;
    requests with time left are served. The backends hold every call until the short deadlines are over
    (a gate, not a delay raced against the machine), so which is which does not depend on speed."""
    async with run_gateway(models_dir=models_dir, **split_backends(models_dir, concurrency=1)) as gw:
        gate = asyncio.Event()
        for name in ("embedded", "gpu"):
            backend(gw, name).gate = gate
        requests = synthetic(30, seed=14)
        patient = fresh_requests(requests[:10], budget_s=30)
        hurried = fresh_requests(requests[10:], budget_s=0.4)
        async with WireClient(gw.endpoint("hgc")) as agent:
            sent_us = now_unix_us()  # before the gateway received them
            ack = await agent.wait_ack(await agent.send([*patient, *hurried]))
            accepted = list(ack.accepted_ids)
            assert len(accepted) == 30
            await wait_for(lambda: sum(backend(gw, n).calls for n in ("embedded", "gpu")) > 0)
            last_hurried = max(r.deadline_unix_us for r in hurried)
            await wait_for(lambda: now_unix_us() > last_hurried, what="the short deadlines passed")
            gate.set()
            responses = await agent.wait_responses(accepted, timeout_s=20)
    by_id = {r.request_id: r for r in responses}
    assert {by_id[r.request_id].status for r in hurried} == {pb.STATUS_DEADLINE_EXCEEDED}
    assert {by_id[r.request_id].status for r in patient} == {pb.STATUS_OK}
    deadlines = {r.request_id: r.deadline_unix_us for r in patient}
    for request in patient:
        response = by_id[request.request_id]
        # timing.total_us runs from the gateway's receipt (after sent_us) to its answer: sent_us plus it is
        # no later than the answer, which must not be later than the request's deadline.
        assert sent_us + response.timing.total_us <= deadlines[request.request_id], response.timing
    shed = {
        r: sum(sample(gw, "hkgw_shed_total", pool=p, reason=r) or 0 for p in gw.pools)
        for r in ("deadline", "late")
    }
    assert shed["deadline"] + shed["late"] == len(hurried)


async def test_failing_backend_trips_breaker_and_traffic_spills_then_returns(models_dir: Path) -> None:
    """Cloud backend failures open its breaker, requests spill to the CPU pool; after recovery they return."""
    async with run_gateway(models_dir=models_dir, **split_backends(models_dir, open_s=0.5)) as gw:
        gpu = backend(gw, "gpu")
        gpu.fail = True
        heavy = synthetic(20, seed=15)
        for r in heavy:
            r.complexity_hint = 0.95  # the client says: cloud tier
        async with WireClient(gw.endpoint("hgc")) as agent:
            during = await agent.infer(fresh_requests(heavy))
            await wait_for(lambda: gw.snapshot.tiers.get("cloud") is False, timeout_s=5)
            gpu.fail = False
            await wait_for(lambda: gw.pools["gpu-a100-mig"].healthy(time.monotonic()), timeout_s=5)
            calls_before = gpu.calls
            after: list[pb.InferResponse] = []
            deadline = time.monotonic() + 10
            while gpu.calls == calls_before and time.monotonic() < deadline:
                after = await agent.infer(fresh_requests(heavy))
    assert all(r.status == pb.STATUS_OK for r in during)
    assert {r.pool for r in during} == {"cpu"}
    assert {r.route_reason for r in during} <= {"spillover_unhealthy", "complexity", "deadline"}
    assert "spillover_unhealthy" in {r.route_reason for r in during}
    assert sample(gw, "hkgw_backend_calls_total", backend="gpu", outcome="unavailable") >= 2
    assert gpu.calls > calls_before
    assert any(r.tier == pb.TIER_CLOUD for r in after)


async def test_breaker_state_metric_reads_open_then_closed_after_recovery(models_dir: Path) -> None:
    """hkgw_breaker_state is 2 while failures hold the breaker open and 0 once a call succeeds again."""
    async with run_gateway(models_dir=models_dir, **split_backends(models_dir, open_s=0.5)) as gw:
        gpu = backend(gw, "gpu")
        heavy = synthetic(20, seed=16)
        for r in heavy:
            r.complexity_hint = 0.95  # the client says: cloud tier
        async with WireClient(gw.endpoint("hgc")) as agent:
            await agent.infer(fresh_requests(heavy))  # served: the gauge exists, closed
            closed_at_first = sample(gw, "hkgw_breaker_state", backend="gpu")
            gpu.fail = True
            await agent.infer(fresh_requests(heavy))
            await wait_for(lambda: gw.snapshot.tiers.get("cloud") is False, timeout_s=5)
            opened = sample(gw, "hkgw_breaker_state", backend="gpu")
            gpu.fail = False
            await wait_for(lambda: gw.pools["gpu-a100-mig"].healthy(time.monotonic()), timeout_s=5)
            calls_before = gpu.calls
            deadline = time.monotonic() + 10
            while gpu.calls == calls_before and time.monotonic() < deadline:
                await agent.infer(fresh_requests(heavy))
    assert gpu.calls > calls_before
    assert (closed_at_first, opened) == (0, 2)
    assert sample(gw, "hkgw_breaker_state", backend="gpu") == 0


async def test_drain_deadline_answers_unfinished_batches(models_dir: Path) -> None:
    """Batches still in a backend when the drain deadline passes are answered UNAVAILABLE, never dropped."""
    overrides = split_backends(models_dir)
    overrides["drain_timeout_s"] = 0.3
    async with run_gateway(models_dir=models_dir, **overrides) as gw:
        for name in ("embedded", "gpu"):
            backend(gw, name).delay_s = 5.0  # longer than the drain deadline
        async with WireClient(gw.endpoint("hgc")) as agent:
            requests = synthetic(10, seed=16)
            ack = await agent.wait_ack(await agent.send(requests))
            await wait_for(lambda: any(p.inflight for p in gw.pools.values()))
            await gw.drain()
            responses = await agent.wait_responses(list(ack.accepted_ids), timeout_s=10)
    assert responses
    assert {r.status for r in responses} == {pb.STATUS_UNAVAILABLE}
    assert all(r.retry_after_ms > 0 for r in responses)
    assert agent.duplicate_responses == 0


async def test_a_batch_failing_during_drain_is_answered_not_rerouted_into_a_stopped_pool(
    models_dir: Path,
) -> None:
    """A cloud batch that fails after the drain stopped the pools is answered UNAVAILABLE (retryable):
    rerouting it would queue it on a pool nobody serves any more, and its requests would never be
    answered."""
    overrides = split_backends(models_dir)
    overrides["drain_timeout_s"] = 5.0
    overrides["drain_grace_s"] = 0.0
    async with run_gateway(models_dir=models_dir, **overrides) as gw:
        gpu = backend(gw, "gpu")
        gpu.delay_s = 0.5  # in the backend when the drain starts, failing after it has stopped the pools
        gpu.fail = True
        heavy = synthetic(10, seed=17)
        for r in heavy:
            r.complexity_hint = 0.95  # the client says: cloud tier
        async with WireClient(gw.endpoint("hgc")) as agent:
            ack = await agent.wait_ack(await agent.send(fresh_requests(heavy, budget_s=30)))
            await wait_for(lambda: gpu.calls > 0)
            await gw.drain()
            responses = await agent.wait_responses(list(ack.accepted_ids), timeout_s=10)
        assert sum(p.depth for p in gw.pools.values()) == 0
    assert len(responses) == len(ack.accepted_ids) > 0
    assert {r.status for r in responses} == {pb.STATUS_UNAVAILABLE}
    assert all(r.retry_after_ms > 0 for r in responses)


async def test_batch_larger_than_the_model_takes_is_split_into_calls(models_dir: Path) -> None:
    """A pool batching 128 requests for a model that takes 64 rows answers all of them, in several calls."""
    overrides = split_backends(models_dir)
    overrides["pools"]["cpu"] = {
        "backend": "embedded",
        "max_batch_size": 128,
        "preferred_batch_sizes": [128],
        "max_queue_delay_us": 200_000,
    }
    for pool in overrides["routing"]["pools"]:
        pool["max_queue_depth"] = 1000
    async with run_gateway(models_dir=models_dir, **overrides) as gw, WireClient(gw.endpoint("hgc")) as agent:
        texts = synthetic(128, seed=41, kind=pb.REQUEST_KIND_TEXT)
        for request in texts:
            request.complexity_hint = 0.0  # the CPU pool
        responses = await agent.infer(texts)
        embedded = backend(gw, "embedded")
    assert len(texts) == 128
    assert all(r.status == pb.STATUS_OK for r in responses), {r.error_message for r in responses}
    assert embedded.rows == 128 and embedded.calls >= 2


async def test_text_is_batched_by_size_bucket_to_keep_padding_small(models_dir: Path) -> None:
    """Short queries and long descriptions queued together: grouped by size bucket they go out as dense
    batches; with group_by_size off they share batches padded to the longest (hkgw_padding_waste_ratio)."""
    words = [
        "genuine",
        "xiaomi",
        "power",
        "bank",
        "waterproof",
        "ships",
        "from",
        "hong",
        "kong",
        "in",
        "business",
        "days",
    ]
    short = [pb.TextQuery(text="wireless earbuds") for _ in range(24)]
    long = [pb.TextQuery(text=" ".join(words * 5)) for _ in range(24)]
    waste: dict[bool, float] = {}
    for grouped in (True, False):
        overrides = split_backends(models_dir)
        overrides["pools"]["cpu"] = {
            "backend": "embedded",
            "max_batch_size": 64,
            "preferred_batch_sizes": [48],
            "max_queue_delay_us": 300_000,
            "group_by_size": grouped,
        }
        requests = fresh_requests(synthetic(48, seed=43, kind=pb.REQUEST_KIND_TEXT))
        for request, text in zip(
            requests, [x for pair in zip(short, long, strict=True) for x in pair], strict=True
        ):
            request.text.CopyFrom(text)
            request.complexity_hint = 0.0  # the CPU pool
        async with run_gateway(models_dir=models_dir, **overrides) as gw:
            async with WireClient(gw.endpoint("hgc")) as agent:
                responses = await agent.infer(requests)
            assert all(r.status == pb.STATUS_OK for r in responses), {r.error_message for r in responses}
            total = sample(gw, "hkgw_padding_waste_ratio_sum", model="text-encoder")
            batches = sample(gw, "hkgw_padding_waste_ratio_count", model="text-encoder")
        assert batches >= 1
        waste[grouped] = total / batches
    assert waste[True] < 0.2 < waste[False], waste


async def test_short_texts_share_one_queue_up_to_short_text_tokens(models_dir: Path) -> None:
    """With ``short_text_tokens = 16`` a frame's texts estimated at up to 16 tokens (buckets 4, 8 and 16
    here) go in one backend call, padded to the longest of them, and longer ones apart; with 0, one call per
    bucket."""
    phrase = "genuine xiaomi power bank waterproof ships from hong kong in five business days"
    texts = ["earbuds", "wireless earbuds", "genuine xiaomi power bank waterproof ships", phrase]
    texts = [*texts, *texts, f"{phrase} {phrase}", f"{phrase} {phrase}"]  # eight short ones, two long
    assert [length_bucket(estimated_tokens(t)) for t in texts[3:]] == [16, 4, 4, 8, 16, 32, 32]
    calls: dict[int, tuple[int, int]] = {}
    for short in (0, 16):
        overrides = split_backends(models_dir)
        overrides["pools"]["cpu"] = {
            "backend": "embedded",
            "max_batch_size": 64,
            "max_queue_delay_us": 50_000,  # the frame's slices all queued before any is cut
            "short_text_tokens": short,
        }
        requests = fresh_requests(synthetic(len(texts), seed=44, kind=pb.REQUEST_KIND_TEXT))
        for request, text in zip(requests, texts, strict=True):
            request.text.CopyFrom(pb.TextQuery(text=text))
            request.complexity_hint = 0.0  # the CPU pool
            request.priority = pb.PRIORITY_CLASS_INTERACTIVE  # one lane: no realtime batch cut apart
        async with run_gateway(models_dir=models_dir, **overrides) as gw:
            async with WireClient(gw.endpoint("hgc")) as agent:
                responses = await agent.infer(requests)
            assert all(r.status == pb.STATUS_OK for r in responses), {r.error_message for r in responses}
            embedded = backend(gw, "embedded")
            calls[short] = (embedded.calls, embedded.rows)
    # The pool's preferred batch size 8 (fault_injecting_pools' cpu pool) cuts the shared queue of the
    # eight short ones at once; apart, each bucket's queue is cut when its delay is over.
    assert calls == {0: (4, 10), 16: (2, 10)}, calls


async def test_realtime_request_does_not_wait_for_company(models_dir: Path) -> None:
    """With a max_queue_delay far longer than the test may run, a lone interactive request stays queued
    waiting for company, and a realtime request for the same model cuts the batch at once
    (realtime_queue_delay_us defaults to 0): both go to the backend in that one call."""
    overrides = split_backends(models_dir)
    overrides["pools"]["cpu"] = {
        "backend": "embedded",
        "max_batch_size": 64,
        "max_queue_delay_us": 3_600_000_000,  # an hour: only a cut for another reason serves it in time
    }
    waiting, realtime = fresh_requests(synthetic(2, seed=47, kind=pb.REQUEST_KIND_TEXT), budget_s=30)
    for request, priority in (
        (waiting, pb.PRIORITY_CLASS_INTERACTIVE),
        (realtime, pb.PRIORITY_CLASS_REALTIME),
    ):
        request.complexity_hint = 0.0  # the CPU pool
        request.priority = priority
        request.text.text = "wireless earbuds"  # one size bucket: one queue
    async with run_gateway(models_dir=models_dir, **overrides) as gw, WireClient(gw.endpoint("hgc")) as agent:
        embedded, cpu = backend(gw, "embedded"), gw.pools["cpu"]
        ack = await agent.wait_ack(await agent.send([waiting]))
        assert list(ack.accepted_ids) == [waiting.request_id]
        await agent.ping()  # handled after the batcher's pass over the queue: it chose to wait
        assert (cpu.depth, embedded.calls) == (1, 0)
        responses = await agent.infer([realtime], timeout_s=20)
        responses += await agent.wait_responses([waiting.request_id], timeout_s=20)
        batches = sample(gw, "hkgw_batch_size_count", pool="cpu")
    assert [(r.status, r.pool) for r in responses] == [(pb.STATUS_OK, "cpu")] * 2, responses
    assert (embedded.calls, embedded.rows, batches) == (1, 2, 1)


async def test_pipeline_declared_in_the_gateway_config_overrides_the_models(models_dir: Path) -> None:
    """[pipelines.text-encoder] parameters = {max_tokens = "8"}: a 20-word text is cut to 8 tokens (counted),
    where the model's own config (128) serves it whole; a declaration for an unknown model is refused."""
    words = " ".join(["wireless", "earbuds", "noise", "cancelling", "waterproof"] * 4)
    truncated: dict[bool, float] = {}
    for declared in (False, True):
        overrides = split_backends(models_dir)
        if declared:
            overrides["pipelines"] = {"text-encoder": {"parameters": {"max_tokens": "8"}}}
        request = synthetic(8, seed=48, kind=pb.REQUEST_KIND_TEXT)[0]
        request.text.text = words
        request.complexity_hint = 0.0
        async with (
            run_gateway(models_dir=models_dir, **overrides) as gw,
            WireClient(gw.endpoint("hgc")) as agent,
        ):
            (response,) = await agent.infer([request])
            assert response.status == pb.STATUS_OK, response
            truncated[declared] = sample(gw, "hkgw_input_truncated_total", model="text-encoder")
    assert truncated == {False: 0.0, True: 1.0}
    bad = split_backends(models_dir)
    bad["pipelines"] = {"no-such-model": {"pipeline": "text"}}
    with pytest.raises(ConfigError) as caught:
        load_config(environ={}, overrides=loopback_overrides(models_dir, **bad))
    assert [key for key, _ in caught.value.problems] == ["pipelines.no-such-model"]


def one_text_queue(models_dir: Path, batch: int, delay_us: int) -> dict[str, Any]:
    """Overrides: the CPU pool on the embedded backend, batches of ``batch`` (also its preferred size) or
    after ``delay_us``, one call at a time."""
    overrides = split_backends(models_dir, concurrency=1, queue_depth=1000)
    overrides["pools"]["cpu"] = {
        "backend": "embedded",
        "max_batch_size": batch,
        "preferred_batch_sizes": [batch],
        "max_queue_delay_us": delay_us,
    }
    return overrides


@contextlib.asynccontextmanager
async def flood_beside(
    models_dir: Path, overrides: dict[str, Any]
) -> AsyncIterator[tuple[Gateway, WireClient, WireClient, FaultInjectingBackend]]:
    """A gateway on ``overrides``, a flooding agent (a1, on hgc), another agent (a2, on pccw), and the
    embedded backend with its calls held (``gate``) and their inputs recorded."""
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="a1") as flooding,
        WireClient(gw.endpoint("pccw"), agent_id="a2") as other,
    ):
        embedded = backend(gw, "embedded")
        embedded.gate, embedded.inputs = asyncio.Event(), []
        yield gw, flooding, other, embedded


def flood_and_lone(n: int, seed: int) -> tuple[list[pb.InferRequest], list[pb.InferRequest]]:
    """``n`` interactive text requests for the CPU pool, all in one queue (one size bucket): the first
    ``n - 1`` alike (a flood), the last with a text of its own (its own row in a batch's inputs)."""
    requests = fresh_requests(synthetic(n, seed=seed, kind=pb.REQUEST_KIND_TEXT), budget_s=30)
    for request in requests:
        request.complexity_hint = 0.0  # the CPU pool
        request.priority = pb.PRIORITY_CLASS_INTERACTIVE
        request.text.text = "wireless earbuds"
    requests[-1].text.text = "xiaomi bank"
    return requests[:-1], requests[-1:]


def batch_rows(calls: list[Mapping[str, np.ndarray]]) -> tuple[list[np.ndarray], list[int]]:
    """Each call's input rows, and the calls holding a row unlike the first call's first (the lone's)."""
    rows = [np.concatenate([np.asarray(v).reshape(len(v), -1) for v in c.values()], axis=1) for c in calls]
    flood_row = rows[0][0]
    return rows, [i for i, batch in enumerate(rows) if any((row != flood_row).any() for row in batch)]


async def lone_then_release(
    gw: Gateway,
    clients: tuple[WireClient, WireClient],
    flood: list[pb.InferRequest],
    lone: list[pb.InferRequest],
    priority: pb.PriorityClass.ValueType,
) -> tuple[list[pb.InferResponse], list[Mapping[str, np.ndarray]]]:
    """With the first call held and the flood's rest queued: the other agent's lone request queued after
    them, then the call let go; every answer, the lone's first, and each call's inputs."""
    flooding, other = clients
    embedded, cpu = backend(gw, "embedded"), gw.pools["cpu"]
    queued = cpu.depth
    sent = await other.send(lone, priority=priority)
    assert list((await other.wait_ack(sent)).accepted_ids) == [lone[0].request_id]
    await other.ping()
    assert (embedded.calls, cpu.depth) == (1, queued + 1)
    assert embedded.gate is not None and embedded.inputs is not None
    embedded.gate.set()
    answered = await other.wait_responses([lone[0].request_id], timeout_s=20)
    answered += await flooding.wait_responses([r.request_id for r in flood], timeout_s=20)
    return answered, embedded.inputs


async def lone_beside_104(
    models_dir: Path, seed: int, priority: pb.PriorityClass.ValueType, fill_us: int = 2000
) -> tuple[list[pb.InferResponse], list[Mapping[str, np.ndarray]]]:
    """One agent's 104 interactive requests for a model served 64 at a time (the first batch prepared in a
    CPU worker, its call held; 40 wait), then another agent's lone request of ``priority`` for it, then
    the call let go: every answer, the lone's first, and each call's inputs (:func:`lone_then_release`).
    ``fill_us``: the pool's ``realtime_fill_us``."""
    overrides = one_text_queue(models_dir, batch=64, delay_us=200_000)  # the last ones go after 0.2 s
    overrides["pools"]["cpu"]["realtime_fill_us"] = fill_us
    overrides["pools"]["cpu"]["realtime_reserve"] = 0  # the realtime batch waits for the held call
    flood, lone = flood_and_lone(105, seed=seed)
    lone[0].priority = priority
    async with flood_beside(models_dir, overrides) as (gw, flooding, other, embedded):
        cpu = gw.pools["cpu"]
        assert gw.config.cpu.inline_max_requests == 32
        assert len((await flooding.wait_ack(await flooding.send(flood))).accepted_ids) == 104
        await wait_for(lambda: embedded.calls == 1, what="the first call")
        assert cpu.depth == 40
        return await lone_then_release(gw, (flooding, other), flood, lone, priority)


@pytest.mark.parametrize(
    ("fill_us", "sizes"),
    [
        pytest.param(3_600_000_000, [64, 32, 9], id="filled-up-to-inline"),
        pytest.param(0, [64, 1, 40], id="alone-with-no-fill-time"),
    ],
)
async def test_a_realtime_requests_batch_takes_others_only_as_far_as_they_cost_little(
    models_dir: Path, fill_us: int, sizes: list[int]
) -> None:
    """A realtime request queued with 40 of a flood's interactive requests for one model. Its batch takes
    the flood's only as far as they add at most ``realtime_fill_us`` of backend time, by the pool's time
    per request so far (0: none; with the default's 2 ms, how many depends on how long the test held the
    first call), and never past ``cpu.inline_max_requests`` (32, the CPU stage's work then stays in this
    process, no worker round trip each way); the rest go in the next batch (pool.py: ``_realtime_size``).
    Filled with the flood's rows on a device whose time grows with them, a realtime request waited for
    all of them."""
    answered, calls = await lone_beside_104(models_dir, 59, pb.PRIORITY_CLASS_REALTIME, fill_us)
    assert [r.status for r in answered] == [pb.STATUS_OK] * 105
    rows, holding = batch_rows(calls)
    assert holding == [1], holding
    assert [len(batch) for batch in rows] == sizes
    assert (rows[1][0] != rows[0][0]).any()  # the realtime request leads its batch


async def test_a_small_frames_request_is_batched_apart_from_a_floods_large_batch(models_dir: Path) -> None:
    """Another agent's lone interactive request queued with 40 of a flood's for one model: it goes in a
    batch of its own (run in the gateway's process, no CPU worker's round trip each way behind the flood's
    batches), and the flood's 40 in the next one, whole (pool.py: small frames' batches). Before, the 41
    went in one batch through the worker."""
    answered, calls = await lone_beside_104(models_dir, 67, pb.PRIORITY_CLASS_INTERACTIVE)
    assert [r.status for r in answered] == [pb.STATUS_OK] * 105
    rows, holding = batch_rows(calls)
    assert [len(batch) for batch in rows] == [64, 1, 40]  # [64, 41] before
    assert holding == [1], holding


async def test_another_agents_request_goes_in_the_next_batch_not_behind_a_flood(models_dir: Path) -> None:
    """One agent's 63 interactive requests queue for a model served 8 at a time, one call at a time (the
    first call held); another agent's interactive request for it, queued after them, is in the next call,
    not the eighth and last (gateway/dispatch/lanes.py: the agents share each batch of their class)."""
    # A batch goes out full: a cut for no other reason.
    overrides = one_text_queue(models_dir, batch=8, delay_us=3_600_000_000)
    # The held first call makes the pool's time per request long, so a small frame's request would go in a
    # batch of its own (ModelQueue.take_batch, costly: tests/gateway/test_lanes.py); the lane's sharing is
    # what this tests.
    overrides["pools"]["cpu"]["realtime_fill_us"] = 3_600_000_000
    flood, lone = flood_and_lone(64, seed=53)
    async with flood_beside(models_dir, overrides) as (gw, flooding, other, embedded):
        cpu = gw.pools["cpu"]
        assert len((await flooding.wait_ack(await flooding.send(flood))).accepted_ids) == 63
        await flooding.ping()  # after the batcher's pass: the first call holds 8, 55 wait
        assert (embedded.calls, cpu.depth) == (1, 55)
        answered, calls = await lone_then_release(
            gw, (flooding, other), flood, lone, pb.PRIORITY_CLASS_INTERACTIVE
        )
    assert [r.status for r in answered] == [pb.STATUS_OK] * 64
    assert len(calls) == 8 and all(len(next(iter(c.values()))) <= 8 for c in calls)
    _, holding = batch_rows(calls)
    assert holding == [1], holding  # first come first served: [7]


async def test_a_full_queue_takes_another_agents_requests_by_pushing_out_the_floods_newest(
    models_dir: Path,
) -> None:
    """One agent's requests fill the CPU pool's queue (16) while its first batch's call holds, and no other
    pool can take text (the GPU backend is down); another agent's 4 are queued there all the same, up to
    its fair share (8 of 16), and the flood's newest 4 are answered OVERLOADED with a retry-after
    (gateway/dispatch/admission.py). First come first served, the other agent's were refused OVERLOADED.
    The flood's own further requests still find the queue full."""
    overrides = one_text_queue(models_dir, batch=8, delay_us=3_600_000_000)
    overrides["pools"]["cpu"]["realtime_fill_us"] = 3_600_000_000  # the other's 4 ride the flood's batches
    for pool in overrides["routing"]["pools"]:
        pool["max_queue_depth"] = 16
    flood, lone = flood_and_lone(29, seed=61)
    others = fresh_requests(lone * 4, budget_s=30)
    async with flood_beside(models_dir, overrides) as (gw, flooding, other, embedded):
        cpu = gw.pools["cpu"]
        backend(gw, "gpu").healthy = False
        assert len((await flooding.wait_ack(await flooding.send(flood[:8]))).accepted_ids) == 8
        await wait_for(lambda: embedded.calls == 1, what="the first call")
        assert len((await flooding.wait_ack(await flooding.send(flood[8:24]))).accepted_ids) == 16
        assert cpu.depth == 16
        ack = await other.wait_ack(await other.send(others))
        assert sorted(ack.accepted_ids) == sorted(r.request_id for r in others)
        assert cpu.depth == 16
        pushed = [r.request_id for r in flood[20:24]]  # the flood's newest
        answers = await flooding.wait_responses(pushed, timeout_s=10)
        # Over its share the flood's next requests find the pool full: refused, nothing pushed out.
        more = await flooding.wait_ack(await flooding.send(flood[24:28]))
        assert cpu.depth == 16
        assert [n.reason for n in more.nacks] == [pb.NACK_REASON_OVERLOADED] * 4
        embedded.gate.set()
        served = await other.wait_responses([r.request_id for r in others], timeout_s=20)
        served += await flooding.wait_responses([r.request_id for r in flood[:20]], timeout_s=20)
    assert all(a.status == pb.STATUS_OVERLOADED and a.retry_after_ms > 0 for a in answers)
    assert all("pushed out for another agent's requests" in a.error_message for a in answers)
    assert [r.status for r in served] == [pb.STATUS_OK] * 24
    assert {r.pool for r in served[:4]} == {"cpu"}  # queued where they were routed, not spilled
    assert sample(gw, "hkgw_shed_total", pool="cpu", reason="pushed_out") == 4
    assert not more.accepted_ids


async def test_a_full_queue_of_batch_requests_takes_the_same_agents_more_urgent_ones_in_their_place(
    models_dir: Path,
) -> None:
    """One agent's batch requests fill the CPU pool's queue (16) while its first batch's call holds, and no
    other pool can take text (the GPU backend is down). The same agent's realtime request, then its
    interactive ones, are queued all the same, each in the place of the newest batch request, which is
    answered OVERLOADED with a retry-after (gateway/dispatch/admission.py: preempt). Before, an agent is
    always at its own share, so its batch flood refused its realtime requests. A further batch request
    still finds the queue full, and the realtime request is served first when the call is let go."""
    overrides = one_text_queue(models_dir, batch=8, delay_us=3_600_000_000)
    overrides["pools"]["cpu"]["realtime_fill_us"] = 3_600_000_000  # the other's 4 ride the flood's batches
    for pool in overrides["routing"]["pools"]:
        pool["max_queue_depth"] = 16
    overrides["pools"]["cpu"]["realtime_fill_us"] = 3_600_000_000  # its batch filled to 8, as the flood's
    overrides["pools"]["cpu"]["realtime_reserve"] = 0  # and it waits for the held call
    flood, lone = flood_and_lone(30, seed=71)
    for request in flood:
        request.priority = pb.PRIORITY_CLASS_BATCH
    urgent = fresh_requests(lone, budget_s=30)
    urgent[0].priority = pb.PRIORITY_CLASS_REALTIME
    interactive = fresh_requests(lone * 2, budget_s=30)
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="a1") as agent,
    ):
        embedded, cpu = backend(gw, "embedded"), gw.pools["cpu"]
        embedded.gate, embedded.inputs = asyncio.Event(), []
        backend(gw, "gpu").healthy = False
        batch = pb.PRIORITY_CLASS_BATCH
        assert len((await agent.wait_ack(await agent.send(flood[:8], priority=batch))).accepted_ids) == 8
        await wait_for(lambda: embedded.calls == 1, what="the first call")
        assert len((await agent.wait_ack(await agent.send(flood[8:24], priority=batch))).accepted_ids) == 16
        assert cpu.depth == 16
        sent = await agent.send(urgent, priority=pb.PRIORITY_CLASS_REALTIME)
        assert list((await agent.wait_ack(sent)).accepted_ids) == [urgent[0].request_id]
        ack = await agent.wait_ack(await agent.send(interactive))
        assert sorted(ack.accepted_ids) == sorted(r.request_id for r in interactive)
        assert cpu.depth == 16
        preempted = await agent.wait_responses([r.request_id for r in flood[21:24]], timeout_s=10)
        more = await agent.wait_ack(await agent.send(flood[24:26], priority=batch))
        assert [n.reason for n in more.nacks] == [pb.NACK_REASON_OVERLOADED] * 2
        assert not more.accepted_ids and cpu.depth == 16
        embedded.gate.set()
        served = await agent.wait_responses([urgent[0].request_id], timeout_s=20)
        served += await agent.wait_responses([r.request_id for r in interactive], timeout_s=20)
        served += await agent.wait_responses([r.request_id for r in flood[:21]], timeout_s=20)
        calls = embedded.inputs
    assert all(a.status == pb.STATUS_OVERLOADED and a.retry_after_ms > 0 for a in preempted)
    assert all("pushed out for more urgent requests" in a.error_message for a in preempted)
    assert [r.status for r in served] == [pb.STATUS_OK] * 24
    assert sample(gw, "hkgw_shed_total", pool="cpu", reason="preempted") == 3
    assert sample(gw, "hkgw_shed_total", pool="cpu", reason="pushed_out") == 0
    rows, holding = batch_rows(calls)
    assert [len(batch) for batch in rows] == [8, 8, 8]
    assert holding == [1], holding  # the realtime and interactive requests in the call after the held one


async def test_a_realtime_request_is_not_held_late_by_the_batch_requests_it_is_served_before(
    models_dir: Path,
) -> None:
    """The CPU pool (one call at a time, the first held) queues 984 batch requests and no other pool can
    take text. A realtime request with 0.6 s left is queued there and served, as the pool serves its
    realtime lane first: routing's wait estimate for it counts the requests as urgent as it or more (none),
    not the whole queue (PoolSignals.urgent_depth). By the whole queue, as before, routing refuses it
    DEADLINE_EXPIRED: the estimate says it would be late (checked below with the gateway's own policy)."""
    overrides = one_text_queue(models_dir, batch=8, delay_us=3_600_000_000)
    flood, lone = flood_and_lone(993, seed=73)
    for request in flood:
        request.priority = pb.PRIORITY_CLASS_BATCH
    async with (
        run_gateway(models_dir=models_dir, **overrides) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="a1") as agent,
    ):
        embedded, cpu = backend(gw, "embedded"), gw.pools["cpu"]
        embedded.gate = asyncio.Event()
        backend(gw, "gpu").healthy = False
        batch = pb.PRIORITY_CLASS_BATCH
        for part in (flood[:496], flood[496:]):
            assert len((await agent.wait_ack(await agent.send(part, priority=batch))).accepted_ids) == 496
        await wait_for(lambda: embedded.calls == 1, what="the first call")
        signals = cpu.signals(time.monotonic())
        assert (signals.queue_depth, signals.urgent_depth) == (984, (0, 0))
        urgent = fresh_requests(lone, budget_s=0.6)
        urgent[0].priority = pb.PRIORITY_CLASS_REALTIME
        profile = profile_of(urgent[0], Priority.REALTIME, 0.6, "us-west")
        policy = gw.policy.policy
        whole_queue = replace(signals, urgent_depth=None)
        assert policy.estimate_latency(profile, "cpu", whole_queue) > 0.6  # late, counting every one
        assert policy.estimate_latency(profile, "cpu", signals) < 0.1
        ack = await agent.wait_ack(await agent.send(urgent, priority=pb.PRIORITY_CLASS_REALTIME))
        assert list(ack.accepted_ids) == [urgent[0].request_id], ack
        embedded.gate.set()
        answer = await agent.wait_responses([urgent[0].request_id], timeout_s=10)
    assert answer[0].status == pb.STATUS_OK
    assert (answer[0].pool, answer[0].route_reason) == ("cpu", "complexity")


@pytest.mark.parametrize(("reserve", "calls"), [(2, 3), (0, 1)])
async def test_realtime_batches_go_past_a_full_concurrency_up_to_the_reserve(
    models_dir: Path, reserve: int, calls: int
) -> None:
    """The CPU pool serves one call at a time and a flood's first call holds it (8 more of the flood
    queued). Three realtime requests in frames of their own: each goes to the backend at once in a batch of
    its own while fewer than ``realtime_reserve`` (2) extra calls are in flight, past ``concurrency`` (as
    Envoy keeps limits of its own for high-priority requests); the flood's next batch still waits for the
    one slot, and so does the third realtime request. With no reserve, all of them wait."""
    overrides = one_text_queue(models_dir, batch=8, delay_us=3_600_000_000)
    overrides["pools"]["cpu"]["realtime_reserve"] = reserve
    overrides["pools"]["cpu"]["realtime_fill_us"] = 0  # realtime batches alone: the flood's stay whole
    flood, lone = flood_and_lone(17, seed=79)
    urgent = fresh_requests(lone * 3, budget_s=30)
    for request in urgent:
        request.priority = pb.PRIORITY_CLASS_REALTIME
    async with flood_beside(models_dir, overrides) as (gw, flooding, other, embedded):
        cpu = gw.pools["cpu"]
        backend(gw, "gpu").healthy = False
        assert len((await flooding.wait_ack(await flooding.send(flood))).accepted_ids) == 16
        await wait_for(lambda: embedded.calls == 1, what="the first call")
        for request in urgent:
            ack = await other.wait_ack(await other.send([request], priority=pb.PRIORITY_CLASS_REALTIME))
            assert list(ack.accepted_ids) == [request.request_id]
        await other.ping()  # after the batchers' passes
        assert (embedded.calls, cpu.inflight, cpu.depth) == (calls, calls, 8 + 3 - (calls - 1))
        embedded.gate.set()
        served = await other.wait_responses([r.request_id for r in urgent], timeout_s=20)
        served += await flooding.wait_responses([r.request_id for r in flood], timeout_s=20)
    assert [r.status for r in served] == [pb.STATUS_OK] * 19
    rows, _ = batch_rows(embedded.inputs)
    assert [len(batch) for batch in rows[:calls]] == [8] + [1] * (calls - 1)
