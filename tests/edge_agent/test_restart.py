"""Answers survive a restart (issue 23 item 4): every request the agent acked is answered to its caller
once, across a kill -9 of the agent process and across a restart of the calling service."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.synthetic import SyntheticTraffic
from edgewire import new_id, pb
from gateway.server import Gateway
from gateway.testing import FaultInjectingBackend, fault_injecting_pools, run_gateway, wait_for
from tests.edge_agent.conftest import NOWHERE, agent_config, spawn_agent

DEADLINE_S = 30.0


def slow_backends() -> dict[str, Any]:
    """Every pool on fault-injecting wrappers of the null backend (the demo models): a test sets how long
    each call takes, so requests the gateway accepted are still running when the fault comes."""
    return fault_injecting_pools({"type": "null"})


def slow_down(gw: Gateway, delay_s: float) -> list[FaultInjectingBackend]:
    found = [b for b in gw.backends.values() if isinstance(b, FaultInjectingBackend)]
    assert len(found) == 2
    for backend in found:
        backend.delay_s = delay_s
    return found


def accepted_at(gw: Gateway) -> float:
    """Requests the gateway accepted as new, every carrier (a resend it dedupes is not one): each is run
    once."""
    return sum(
        gw.metrics.registry.get_sample_value("hkgw_requests_accepted_total", {"carrier": name}) or 0.0
        for name in gw.carriers
    )


def requests(n: int, seed: int) -> list[pb.InferRequest]:
    """Synthetic requests with their ids, interactive and batch (the spooled classes) alternately."""
    out = []
    for i, generated in enumerate(SyntheticTraffic(seed, regions=("us-west",)).take(n)):
        request = generated.request
        request.request_id = new_id()
        request.priority = pb.PRIORITY_CLASS_BATCH if i % 2 else pb.PRIORITY_CLASS_INTERACTIVE
        out.append(request)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_restarted_caller_gets_its_parked_answers_once(models_dir: Path, tmp_path: Path) -> None:
    """A service sends requests and dies before their answers: the agent parks them for its caller id;
    the service, restarted with the same caller id, sends the same requests and gets each answer once,
    from a gateway that ran each once; another caller cannot take them."""
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        slow_down(gw, 0.5)
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        config = agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        async with EdgeAgent(config) as agent:
            assert agent.uplink is not None and agent.callers is not None
            uplink, parked = agent.uplink, agent.callers.parked
            await wait_for(lambda: uplink.best() is not None)
            sent = requests(30, seed=41)
            ids = {r.request_id for r in sent}
            async with EdgeClient(agent.intake_endpoint, caller_id="checkout.host-7") as first:
                calls = asyncio.gather(*(first.infer(r, deadline_s=DEADLINE_S) for r in sent))
                await wait_for(lambda: set(first.accepted) >= ids, what="every request acked")
                calls.cancel()  # the service dies before any answer (0.5 s a backend call)
                await asyncio.gather(calls, return_exceptions=True)
            await wait_for(lambda: len(parked) == len(ids), timeout_s=DEADLINE_S, what="answers parked")
            async with EdgeClient(agent.intake_endpoint, caller_id="someone-else") as other:
                (stolen,) = await other.infer_many([sent[0]])
            async with EdgeClient(agent.intake_endpoint, caller_id="checkout.host-7") as again:
                answers = await again.infer_many(sent)  # same ids and deadlines: deadline_s not given
                duplicates, dropped = set(again.accepted), again.dropped_answers
            ran = accepted_at(gw)
    assert stolen.status == pb.STATUS_INVALID_ARGUMENT and "already used" in stolen.error_message
    assert [a.request_id for a in answers] == [r.request_id for r in sent]
    assert Counter(a.status for a in answers) == Counter({pb.STATUS_OK: len(sent)})
    assert duplicates == ids  # re-attached (Ack duplicate_ids), none taken as new
    assert dropped == 0  # no second copy of any answer reached the caller
    assert (parked.parked, parked.claimed, len(parked)) == (len(ids), len(ids), 0)
    assert parked.dropped == {"expired": 0, "full": 0}
    assert ran == len(ids)  # each ran once at the gateway: the second time was answered by the agent


async def test_agent_killed_under_load_answers_every_acked_request_once(
    models_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of a real agent process under load, requests accepted by the gateway still running: the
    client keeps its caller id, reconnects to the restarted agent and sends again what it waits for;
    every request the agent acked gets exactly one answer, none lost, none orphaned."""
    intake_port, http_port = free_port(), free_port()
    async with run_gateway(models_dir=models_dir, **slow_backends()) as gw:
        slow_down(gw, 0.3)
        toml = tmp_path / "agent.toml"
        carriers = "\n".join(
            f'[[carriers]]\nname = "{name}"\nendpoint = "{gw.endpoint(name)}"' for name in gw.carriers
        )
        toml.write_text(f"""
region = "us-west"
intake = "tcp://127.0.0.1:{intake_port}"
{carriers}
[local]
enabled = false
[spool]
directory = "{tmp_path / "spool"}"
[uplink]
ping_interval_s = 0.1
dead_after_s = 0.6
[http]
port = {http_port}
[logging]
format = "json"
level = "info"
""")
        proc = await spawn_agent(toml)
        restarted: asyncio.subprocess.Process | None = None
        try:
            traffic = requests(600, seed=43)
            async with EdgeClient(f"tcp://127.0.0.1:{intake_port}", caller_id="search.host-1") as client:
                calls: list[asyncio.Task[pb.InferResponse]] = []

                async def offer(batch: list[pb.InferRequest]) -> None:
                    for request in batch:  # about 250 requests/s, open loop
                        calls.append(asyncio.create_task(client.infer(request, deadline_s=DEADLINE_S)))
                        await asyncio.sleep(0.004)

                await offer(traffic[:300])
                await wait_for(lambda: len(client.accepted) > 250, timeout_s=20, what="250 acked")
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
                unanswered_at_kill = {c for c in calls if not c.done()}
                acked_at_kill = set(client.accepted)
                restarted = await spawn_agent(toml, capture=True)
                await offer(traffic[300:])  # queued in the client's socket until the agent is back
                done, late = await asyncio.wait(calls, timeout=DEADLINE_S + 10)
                reconnects, resent, dropped = client.reconnects, client.resent, client.dropped_answers
                acked = set(client.accepted)
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{http_port}/metrics") as resp,
            ):
                metrics = await resp.text()
        finally:
            for process in (proc, restarted):
                if process is not None and process.returncode is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    await process.wait()
    assert restarted is not None and restarted.stderr is not None
    log = [json.loads(line) for line in (await restarted.stderr.read()).splitlines() if line.startswith(b"{")]
    recovered = sum(e.get("count", 0) for e in log if e.get("event") == "resending spooled requests")
    assert not late
    answers = {c.result().request_id: c.result() for c in done}
    assert len(answers) == len(traffic)
    lost = [a for a in answers.values() if "no answer from the edge agent" in a.error_message]
    assert lost == []
    not_ok = [(answers[rid].status, answers[rid].error_message) for rid in acked if answers[rid].status != 1]
    assert Counter(answers[rid].status for rid in acked) == Counter({pb.STATUS_OK: len(acked)}), not_ok
    assert dropped == 0  # no caller got a second answer for a request
    assert "edge_orphan_responses_total 0.0" in metrics
    # The fault was real: requests acked before the kill were still unanswered when it came, the
    # restarted agent recovered some from its spool, and the client reconnected and sent again.
    pending = {c.result().request_id for c in unanswered_at_kill} & acked_at_kill
    assert len(pending) > 0 and recovered > 0
    assert reconnects >= 1 and resent > 0


async def test_an_answer_nobody_claims_expires_and_is_counted(models_dir: Path, tmp_path: Path) -> None:
    """A caller that leaves for good: its answer is parked, then dropped at its deadline plus the grace
    by the agent's own timer (nothing else happening), and counted as expired."""
    config = agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    async with EdgeAgent(config) as agent:
        assert agent.callers is not None
        parked = agent.callers.parked
        (request,) = requests(1, seed=45)
        async with EdgeClient(agent.intake_endpoint, caller_id="gone.for.good") as client:
            call = asyncio.create_task(client.infer(request, deadline_s=0.3))
            await wait_for(lambda: request.request_id in client.accepted, what="the request acked")
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        # Hong Kong is unreachable: the agent answers DEADLINE_EXCEEDED at the deadline, to nobody.
        await wait_for(lambda: parked.parked == 1, what="the answer parked")
        await wait_for(lambda: parked.dropped["expired"] == 1, what="the parked answer expired")
        held, spooled = len(parked), agent.spool.live_records if agent.spool else -1
    assert held == 0 and parked.claimed == 0 and parked.dropped["full"] == 0
    assert spooled == 0  # answered (DEADLINE_EXCEEDED): out of the spool
