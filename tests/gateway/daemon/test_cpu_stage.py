"""The CPU stage runs in worker processes; a worker that dies is replaced and its batch answered retryable."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from edgewire import pb
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic


async def test_pipelines_run_in_other_processes(models_dir: Path) -> None:
    """With mode=process the CPU stage's workers are separate processes that serve every request kind."""
    async with run_gateway(models_dir=models_dir, cpu={"mode": "process", "workers": 1}) as gw:
        assert gw.cpu is not None
        pids = gw.cpu.pids()
        assert pids
        assert os.getpid() not in pids
        async with WireClient(gw.endpoint("hgc")) as agent:
            responses = await agent.infer(synthetic(30, seed=61))
    assert all(r.status == pb.STATUS_OK for r in responses)


async def test_dead_worker_is_replaced_and_its_batch_answered(models_dir: Path) -> None:
    """Killing the CPU worker: affected requests are answered (served after reroute, or UNAVAILABLE with a
    retry-after), the pool is replaced, and the next requests are served."""
    async with run_gateway(models_dir=models_dir, cpu={"mode": "process", "workers": 1}) as gw:
        assert gw.cpu is not None
        (victim,) = gw.cpu.pids()
        os.kill(victim, signal.SIGKILL)
        requests = fresh_requests(synthetic(20, seed=62))
        async with WireClient(gw.endpoint("pccw")) as agent:
            first = await agent.infer(requests)
            await wait_for(lambda: gw.cpu is not None and gw.cpu.restarts >= 1)
            second = await agent.infer(fresh_requests(synthetic(20, seed=63)))
        assert gw.cpu.pids() != [victim]
        restarts = gw.metrics.registry.get_sample_value("hkgw_cpu_worker_restarts_total")
    assert {r.status for r in first} <= {pb.STATUS_OK, pb.STATUS_UNAVAILABLE}
    assert all(r.retry_after_ms > 0 for r in first if r.status == pb.STATUS_UNAVAILABLE)
    assert all(r.status == pb.STATUS_OK for r in second)
    assert restarts is not None
    assert restarts >= 1
