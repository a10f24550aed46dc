"""A gateway with ``shards = 2`` as a process: the front forwards every frame of an agent to its shard, on
any carrier; a shard killed under traffic is restarted while the other keeps serving, and what its agents
resend is answered once; the merged /metrics adds up; CURVE with ZAP in the front."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import zmq.auth
from prometheus_client.parser import text_string_to_metric_families

from edgewire import new_id, pb
from gateway.ingress.auth import write_keypair
from gateway.shards.placement import shard_of
from gateway.testing import WireClient, fresh_requests, wait_for
from tests.gateway.daemon.process import GatewayProcess, write_config
from tests.gateway.daemon.test_serving import synthetic

SHARDS = 2
START_S = 90.0  # a front and two shards (ONNX models, CPU workers) on a 2-core machine

Samples = list[tuple[str, dict[str, str], float]]


def shards_config(path: Path, models_dir: Path, extra: str = "") -> Path:
    """write_config's plaintext gateway with ``shards = 2`` first (any shards line it writes replaced)."""
    write_config(path, models_dir, extra)
    body = [line for line in path.read_text().splitlines() if not re.match(r"\s*shards\s*=", line)]
    path.write_text(f"shards = {SHARDS}\n" + "\n".join(body) + "\n")
    return path


def ids_on_shards(per_shard: int, base: str) -> list[str]:
    """``per_shard`` agent ids on each shard (by placement.shard_of), shard 0's first."""
    found: dict[int, list[str]] = defaultdict(list)
    for n in range(10_000):
        agent = f"{base}-{n}"
        bucket = found[shard_of(agent, SHARDS)]
        if len(bucket) < per_shard:
            bucket.append(agent)
        if all(len(found[i]) == per_shard for i in range(SHARDS)):
            return [a for i in range(SHARDS) for a in found[i]]
    raise AssertionError("no agent ids for every shard")


@contextlib.asynccontextmanager
async def running(config: Path) -> AsyncIterator[GatewayProcess]:
    process = GatewayProcess(config)
    try:
        await process.start(timeout_s=START_S)
        assert process.ready.get("shards") == SHARDS, process.ready
        assert len(process.ready["shard_pids"]) == SHARDS
        yield process
    finally:
        await process.stop()


class Http:
    """The front's HTTP port: /metrics (merged) and carrier health."""

    def __init__(self, process: GatewayProcess, session: aiohttp.ClientSession) -> None:
        self.base = f"http://127.0.0.1:{process.http_port}"
        self.session = session

    async def metrics_text(self) -> str:
        async with self.session.get(f"{self.base}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    async def metrics(self) -> Samples:
        return parse(await self.metrics_text())

    async def carrier(self, name: str) -> str:
        """The carrier's state word (UP, DEGRADED, DRAINING, DOWN)."""
        async with self.session.get(f"{self.base}/health/carriers/{name}") as resp:
            body = await resp.text()
        match = re.match(r"STATUS:(\w+)", body)
        assert match, body
        return match.group(1)


def parse(exposition: str) -> Samples:
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(
        v for n, ls, v in samples if n == name and all(ls.get(k) == want for k, want in labels.items())
    )


async def promtool_check(body: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus); cannot check /metrics")
    result = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "metrics"],
        input=body,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def same_result(a: pb.InferResponse, b: pb.InferResponse) -> bool:
    """Two answers to one request say the same: status, model, outputs (floats to rounding)."""
    if (a.status, a.model_name, len(a.outputs)) != (b.status, b.model_name, len(b.outputs)):
        return False
    for x, y in zip(a.outputs, b.outputs, strict=True):
        if (x.name, x.datatype, list(x.shape)) != (y.name, y.datatype, list(y.shape)):
            return False
        if x.datatype == pb.DATA_TYPE_FP32:
            xs, ys = np.frombuffer(x.raw_data, "<f4"), np.frombuffer(y.raw_data, "<f4")
            if not np.allclose(xs, ys, rtol=1e-4, atol=1e-6):
                return False
        elif x.raw_data != y.raw_data:
            return False
    return True


# ----------------------------------------------------------- every frame of an agent reaches its shard


async def test_a_resend_on_another_carrier_reaches_the_shard_that_answered(
    tmp_path: Path, models_dir: Path
) -> None:
    """Requests asked on hgc and answered, then the same frame (message and request ids) resent by the same
    agent on pccw through a new connection: the shard that ran them knows them (duplicates, not accepted
    again) and answers from its response cache, the same bytes; nothing runs twice. Agents on both shards."""
    agents = ids_on_shards(3, "resend-agent")
    asked: dict[str, tuple[bytes, list[pb.InferRequest], dict[bytes, bytes]]] = {}
    async with (
        running(shards_config(tmp_path / "gateway.toml", models_dir)) as process,
        aiohttp.ClientSession() as session,
    ):
        http = Http(process, session)
        for n, agent_id in enumerate(agents):
            requests = synthetic(4, seed=300 + n)
            async with WireClient(process.endpoint("hgc"), agent_id=agent_id) as first:
                message_id = await first.send(requests)
                ack = await first.wait_ack(message_id, timeout_s=20)
                assert sorted(ack.accepted_ids) == sorted(r.request_id for r in requests), agent_id
                answers = await first.wait_responses([r.request_id for r in requests], timeout_s=30)
            asked[agent_id] = (message_id, requests, {a.request_id: a.SerializeToString() for a in answers})
        before = await http.metrics()
        # Each agent resends on pccw (agents in the reverse order) and then on tgt, each time on a new
        # connection: whatever the connections' routing ids, the frames follow the agent id.
        resends = [("pccw", list(reversed(asked))), ("tgt", list(asked))]
        for carrier, order in resends:
            for agent_id in order:
                message_id, requests, first_answers = asked[agent_id]
                async with WireClient(process.endpoint(carrier), agent_id=agent_id) as moved:
                    sent = await moved.send(requests, message_id=message_id)
                    ack = await moved.wait_ack(sent, timeout_s=20)
                    assert not ack.accepted_ids, f"{agent_id}: the resend on {carrier} reached another shard"
                    assert sorted(ack.duplicate_ids) == sorted(first_answers), agent_id
                    again = await moved.wait_responses(list(first_answers), timeout_s=20)
                    assert {a.request_id: a.SerializeToString() for a in again} == first_answers, agent_id
                    assert moved.duplicate_responses == 0
        after = await http.metrics()
    count = sum(len(requests) for _, requests, _ in asked.values())
    duplicate = "hkgw_requests_duplicate_total"
    for carrier in ("pccw", "tgt"):
        assert total(after, duplicate, carrier=carrier) - total(before, duplicate, carrier=carrier) == count
    assert total(after, "hkgw_requests_accepted_total") == count  # each accepted once, on hgc
    assert total(after, "hkgw_requests_accepted_total", carrier="hgc") == count
    assert total(after, "hkgw_batch_size_sum") == count  # run once each, in all shards together
    assert {shard_of(a, SHARDS) for a in agents} == set(range(SHARDS))


# ----------------------------------------------------------- kill -9 of a shard under traffic

FRAME_REQUESTS = 2
PACE_S = 0.05  # between one agent's frames: the traffic generator's rate, not a synchronisation
MAX_FRAMES = 800  # per agent: bounds the run whatever happens
BUDGET_S = 180.0  # deadlines far enough that a resend after the restart is still in time


class Traffic:
    """One agent sending frames at a steady pace and collecting every ack and answer (duplicates kept)."""

    def __init__(self, client: WireClient, base: Sequence[pb.InferRequest]) -> None:
        self.client = client
        self.base = list(base)
        self.requests: dict[bytes, pb.InferRequest] = {}
        self.sent_at: dict[bytes, float] = {}  # request id -> when it was first sent
        self.acks: list[tuple[float, pb.Ack]] = []
        self.frames_sent_at: dict[bytes, float] = {}  # message id -> when
        self.answers: dict[bytes, list[pb.InferResponse]] = defaultdict(list)
        self.answered_at: dict[bytes, float] = {}  # request id -> when its first answer came

    @property
    def agent_id(self) -> str:
        return self.client.agent_id

    def accepted(self, before: float = float("inf")) -> set[bytes]:
        """The requests acknowledged as accepted (in an ack read before ``before``)."""
        return {rid for at, ack in self.acks if at < before for rid in ack.accepted_ids}

    def unanswered(self) -> list[bytes]:
        return [rid for rid in self.requests if rid not in self.answers]

    def acked_frames_sent_after(self, when: float) -> int:
        return sum(
            1
            for _, ack in self.acks
            if self.frames_sent_at.get(ack.acked_message_id, 0.0) > when and ack.accepted_ids
        )

    async def receive(self, timeout_s: float) -> bool:
        sock = self.client.sock
        if not await sock.poll(max(1, int(timeout_s * 1000))):
            return False
        decoded = self.client.codec.decode(await sock.recv_multipart())
        now = time.monotonic()
        payload = decoded.payload
        if isinstance(payload, pb.Ack):
            self.acks.append((now, payload))
        elif isinstance(payload, pb.ResponseBatch):
            for response in payload.responses:
                self.answers[response.request_id].append(response)
                self.answered_at.setdefault(response.request_id, now)
        return True

    async def listen(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.receive(0.05)

    def acked(self, message_id: bytes) -> bool:
        return any(ack.acked_message_id == message_id for _, ack in self.acks)

    async def send(self, requests: Sequence[pb.InferRequest]) -> bytes:
        now = time.monotonic()
        for r in requests:
            self.requests.setdefault(r.request_id, r)
            self.sent_at.setdefault(r.request_id, now)
        message_id = new_id()
        self.frames_sent_at[message_id] = now
        return await self.client.send(requests, message_id=message_id)

    async def generate(self, stop: asyncio.Event) -> None:
        for n in range(MAX_FRAMES):
            if stop.is_set():
                return
            start = (n * FRAME_REQUESTS) % len(self.base)
            await self.send(fresh_requests(self.base[start : start + FRAME_REQUESTS], budget_s=BUDGET_S))
            await asyncio.sleep(PACE_S)

    async def drain_quietly(self, quiet_s: float, limit_s: float) -> None:
        """Read until nothing came for ``quiet_s`` (or ``limit_s`` passed)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if not await self.receive(min(quiet_s, max(0.01, deadline - time.monotonic()))):
                return

    async def resend_unanswered(self) -> int:
        """Like an agent: what has no answer yet goes again, with its original request ids."""
        missing = self.unanswered()
        for start in range(0, len(missing), 20):
            chunk = [self.requests[rid] for rid in missing[start : start + 20]]
            await self.client.send(chunk)
        return len(missing)


class HealthWatch:
    """Every carrier's state, read every few tens of milliseconds, with when."""

    def __init__(self, http: Http, carriers: Iterable[str]) -> None:
        self.http = http
        self.carriers = list(carriers)
        self.seen: list[tuple[float, dict[str, str]]] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            states = {c: await self.http.carrier(c) for c in self.carriers}
            self.seen.append((time.monotonic(), states))
            await asyncio.sleep(0.03)

    @staticmethod
    def all_in(states: dict[str, str], state: str) -> bool:
        return all(s == state for s in states.values())

    def times(self, state: str) -> list[float]:
        """When every carrier was seen in ``state``."""
        return [t for t, states in self.seen if self.all_in(states, state)]

    def states(self) -> set[str]:
        return {s for _, states in self.seen for s in states.values()}

    def changes(self) -> list[tuple[float, dict[str, str]]]:
        """The readings that differ from the one before (for failure messages)."""
        return [(t, s) for n, (t, s) in enumerate(self.seen) if n == 0 or s != self.seen[n - 1][1]]


async def test_a_killed_shard_is_restarted_and_nothing_acked_is_lost(
    tmp_path: Path, models_dir: Path
) -> None:
    """kill -9 of shard 1 while six agents (three per shard) send: the front restarts it (one restart, two
    serving again), carriers are DEGRADED while it is down and never DOWN; the other shard's agents are
    answered for what they sent during the outage; after the restart the dead shard's agents resend what
    has no answer (original request ids) and every acknowledged request is answered, none twice with
    different results."""
    victim = 1
    agents = ids_on_shards(3, "kill-agent")
    base = synthetic(40, seed=77)
    carriers = ("hgc", "pccw", "tgt")
    async with (
        running(shards_config(tmp_path / "gateway.toml", models_dir)) as process,
        aiohttp.ClientSession() as session,
        contextlib.AsyncExitStack() as stack,
    ):
        http = Http(process, session)
        traffic = [
            Traffic(
                await stack.enter_async_context(
                    WireClient(process.endpoint(carriers[n % 3]), agent_id=agent_id)
                ),
                base,
            )
            for n, agent_id in enumerate(agents)
        ]
        on_victim = [t for t in traffic if shard_of(t.agent_id, SHARDS) == victim]
        survivors = [t for t in traffic if shard_of(t.agent_id, SHARDS) != victim]
        assert len(on_victim) == 3 and len(survivors) == 3
        watch = HealthWatch(http, carriers)
        stop_sending, stop_listening, stop_watching = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(t.listen(stop_listening)) for t in traffic]
        tasks += [asyncio.create_task(t.generate(stop_sending)) for t in traffic]
        watcher = asyncio.create_task(watch.run(stop_watching))
        try:
            # Traffic flows through both shards.
            await wait_for(
                lambda: all(t.acked_frames_sent_after(0.0) >= 3 for t in traffic),
                timeout_s=30,
                what="every agent's frames acknowledged",
            )
            # Work the shard has acknowledged and not answered when it dies: images, each a CPU stage and a
            # model run, killed the moment their ack is read.
            burst = on_victim[0]
            # 48: more than one batch of the image model (32), so that under load too some are unanswered
            # when the kill follows the ack (16 were, on a loaded machine, all answered in the ~20 ms
            # between the ack and a poll of 20 ms; polled every 2 ms now).
            images = fresh_requests(synthetic(48, seed=78, kind=pb.REQUEST_KIND_IMAGE), budget_s=BUDGET_S)
            burst_id = await burst.send(images)
            await wait_for(
                lambda: burst.acked(burst_id), timeout_s=20, interval_s=0.002, what="the burst acknowledged"
            )
            pid = int(process.ready["shard_pids"][victim])
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()

            def restarted() -> bool:
                return any(
                    r.get("event") == "shard started"
                    and r.get("shard") == victim
                    and r.get("incarnation") == 2
                    for r in process.logs
                )

            await wait_for(restarted, timeout_s=30, what="the shard started again")
            started_at = time.monotonic()
            await wait_for(
                lambda: watch.seen[-1][0] > started_at and watch.all_in(watch.seen[-1][1], "UP"),
                timeout_s=60,
                what="every carrier UP again after the restart",
            )
            back_at = time.monotonic()
            # The new incarnation serves its agents' new frames.
            await wait_for(
                lambda: all(t.acked_frames_sent_after(back_at) >= 3 for t in traffic),
                timeout_s=30,
                what="new frames acknowledged by both shards after the restart",
            )
        finally:
            for event in (stop_sending, stop_listening, stop_watching):
                event.set()
            ended = await asyncio.gather(*tasks, watcher, return_exceptions=True)
        failed = [e for e in ended if isinstance(e, BaseException)]
        assert not failed, failed
        # Answers still on their way come in; then what has none is resent, as an agent would.
        resent_rounds = []
        for _ in range(8):
            for t in traffic:
                await t.drain_quietly(quiet_s=1.0, limit_s=10.0)
            if not any(t.unanswered() for t in traffic):
                break
            resent_rounds.append({t.agent_id: await t.resend_unanswered() for t in traffic})
        samples = await http.metrics()

    # Every request acknowledged (by either incarnation) was answered; in fact every request was.
    for t in traffic:
        missing = [rid for rid in t.accepted() if rid not in t.answers]
        assert not missing, f"{t.agent_id}: {len(missing)} acknowledged requests never answered"
        assert not t.unanswered(), f"{t.agent_id}: {len(t.unanswered())} requests unanswered after resends"
        for rid, answers in t.answers.items():
            assert all(same_result(answers[0], a) for a in answers[1:]), (
                f"{t.agent_id}: request {rid.hex()} answered {len(answers)} times, differently"
            )
        statuses = {answers[0].status for answers in t.answers.values()}
        assert pb.STATUS_INTERNAL not in statuses, t.agent_id
        assert pb.STATUS_OK in statuses, t.agent_id
    # The kill took acknowledged work with it: accepted before the kill, answered only once the next
    # incarnation existed (what the checks above found answered after all).
    lost = {
        t.agent_id: [rid for rid in t.accepted(before=killed_at) if t.answered_at[rid] > started_at]
        for t in on_victim
    }
    assert any(lost.values()), "no acknowledged work was in the shard when it was killed"
    # The shard was restarted once, and both serve again.
    assert total(samples, "hkgw_shard_restarts_total") == 1
    assert total(samples, "hkgw_shards_serving") == SHARDS
    assert total(samples, "hkgw_shard_frames_dropped_total", reason="shard_down") >= 1
    # Health: DEGRADED while one shard was down (on every carrier at once), never DOWN.
    assert "DOWN" not in watch.states(), watch.changes()
    degraded = [t for t in watch.times("DEGRADED") if t > killed_at]
    assert degraded, "no carrier was seen DEGRADED while the shard was down"
    assert degraded[0] < started_at < degraded[-1], watch.changes()  # DEGRADED until the new one reports
    # The other shard's agents were answered while no process of shard 1 existed (from the kill to the
    # line saying its next incarnation started), for requests they sent then, and never had to resend.
    start, end = killed_at, started_at
    for t in survivors:
        during = [
            rid for rid, sent in t.sent_at.items() if start <= sent and t.answered_at.get(rid, end + 1) <= end
        ]
        assert during, f"{t.agent_id} (shard {1 - victim}) got no answer while shard {victim} was down"
        assert all(r[t.agent_id] == 0 for r in resent_rounds), (t.agent_id, resent_rounds)
    # The dead shard's agents lost frames during the outage, and their resends were answered.
    assert resent_rounds and sum(resent_rounds[0][t.agent_id] for t in on_victim) > 0, resent_rounds


# ----------------------------------------------------------- merged /metrics


async def test_merged_metrics_add_up_and_pass_promtool(tmp_path: Path, models_dir: Path) -> None:
    """After traffic on every carrier from agents of both shards, the front's /metrics passes promtool, has
    no shard label, and counts each accepted request once (per carrier too)."""
    agents = ids_on_shards(2, "metrics-agent")
    accepted: dict[str, int] = defaultdict(int)
    async with (
        running(shards_config(tmp_path / "gateway.toml", models_dir)) as process,
        aiohttp.ClientSession() as session,
    ):
        http = Http(process, session)
        for n, agent_id in enumerate(agents):
            carrier = ("hgc", "pccw", "tgt")[n % 3]
            async with WireClient(process.endpoint(carrier), agent_id=agent_id) as agent:
                for seed in (n, n + 100):
                    requests = synthetic(5 + n, seed=seed)
                    ack = await agent.wait_ack(await agent.send(requests), timeout_s=20)
                    accepted[carrier] += len(ack.accepted_ids)
                    await agent.wait_responses([r.request_id for r in requests], timeout_s=30)
        body = await http.metrics_text()
    await promtool_check(body)
    samples = parse(body)
    labelled = sorted({n for n, labels, _ in samples if "shard" in labels})
    assert not labelled, f"series with a shard label: {labelled}"
    assert sum(accepted.values()) > 0
    assert total(samples, "hkgw_requests_accepted_total") == sum(accepted.values())
    for carrier, count in accepted.items():
        assert total(samples, "hkgw_requests_accepted_total", carrier=carrier) == count, carrier
    assert total(samples, "hkgw_responses_total") == sum(accepted.values())
    assert total(samples, "hkgw_shards") == SHARDS
    assert total(samples, "hkgw_shards_serving") == SHARDS
    assert total(samples, "hkgw_ready") == 1
    assert total(samples, "hkgw_shard_restarts_total") == 0


# ----------------------------------------------------------- CURVE and ZAP in the front


def curve_of(secret_file: Path, server_secret: Path) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(secret_file)
    server_public, _ = zmq.auth.load_certificate(server_secret)
    assert secret is not None
    return public, secret, server_public


async def test_curve_with_shards_serves_allowed_agents_and_refuses_unknown_keys(
    tmp_path: Path, models_dir: Path
) -> None:
    """With CURVE, ZAP runs in the front: an allowed agent on each shard (placed by its key's agent id) is
    served; a key not in the directory is refused, counted in hkgw_auth_rejected_total, and reaches no
    shard."""
    allowed = ids_on_shards(1, "edge-hk")
    _, server_secret = write_keypair(tmp_path / "server", "gateway")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    secrets: dict[str, Path] = {}
    for agent_id in allowed:
        public, secret = write_keypair(
            tmp_path / agent_id, agent_id, {"agent-id": agent_id, "region": "us-west"}
        )
        shutil.copy(public, authorized / public.name)
        secrets[agent_id] = secret
    _, stranger = write_keypair(tmp_path / "stranger", "edge-mallory", {"agent-id": "edge-mallory"})
    config = shards_config(tmp_path / "gateway.toml", models_dir)
    text = config.read_text()
    curve = f'mode = "curve"\nserver_secret_key = "{server_secret}"\nauthorized_agents = "{authorized}"'
    assert text.count('mode = "plaintext"') == 1
    config.write_text(text.replace('mode = "plaintext"', curve))
    served: dict[str, list[pb.InferResponse]] = {}
    async with running(config) as process, aiohttp.ClientSession() as session:
        http = Http(process, session)
        for n, agent_id in enumerate(allowed):
            carrier = ("hgc", "pccw")[n % 2]
            async with WireClient(
                process.endpoint(carrier), agent_id=agent_id, curve=curve_of(secrets[agent_id], server_secret)
            ) as agent:
                served[agent_id] = await agent.infer(synthetic(4, seed=50 + n), timeout_s=30)
        before = await http.metrics()
        async with WireClient(
            process.endpoint("hgc"), agent_id="edge-mallory", curve=curve_of(stranger, server_secret)
        ) as mallory:
            # ZAP refuses the handshake: a DEALER with no connected peer blocks on send (the frame can only
            # go while libzmq still holds the connecting pipe), so the send is bounded and may not happen.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(mallory.send(synthetic(2, seed=59)), 2.0)

            async def rejected() -> float:
                return total(await http.metrics(), "hkgw_auth_rejected_total", reason="unknown_key")

            deadline = time.monotonic() + 15
            while await rejected() < 1:
                assert time.monotonic() < deadline, "the unknown key was not counted"
                await asyncio.sleep(0.05)
            assert not await mallory.receive_one(0.5)
        after = await http.metrics()
    for agent_id, responses in served.items():
        assert [r.status for r in responses] == [pb.STATUS_OK] * 4, agent_id
    assert {shard_of(a, SHARDS) for a in allowed} == set(range(SHARDS))
    assert total(before, "hkgw_auth_rejected_total") == 0
    assert total(after, "hkgw_auth_rejected_total", reason="unknown_key") >= 1
    frames = "hkgw_frames_received_total"
    assert total(after, frames) == total(before, frames) == len(allowed)  # the stranger's reached no shard
    assert total(after, "hkgw_requests_accepted_total") == 4 * len(allowed)


async def test_a_wedged_shard_is_killed_and_started_again(tmp_path: Path, models_dir: Path) -> None:
    """The watchdog covers every shard: a shard whose loop stops (SIGSTOP: no status any more) makes the
    carriers DEGRADED, is killed after the front's wedged_after_s and started again; the other serves."""
    config = shards_config(tmp_path / "gateway.toml", models_dir)
    async with running(config) as process, aiohttp.ClientSession() as session:
        http = Http(process, session)
        stopped = process.ready["shard_pids"][1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            await wait_for(lambda: _logged(process, "shard stopped reporting; killing it"), timeout_s=40)
            assert await http.carrier("hgc") == "DEGRADED"
            agent0 = ids_on_shards(1, "wedge")[0]
            async with WireClient(process.endpoint("hgc"), agent_id=agent0) as agent:
                served = await agent.infer(fresh_requests(synthetic(4, seed=81), budget_s=20))
            assert {r.status for r in served} == {pb.STATUS_OK}
            await wait_for(lambda: len(process.events("shard started")) >= SHARDS + 1, timeout_s=20)

            async def both_serving() -> bool:
                return total(await http.metrics(), "hkgw_shards_serving") == SHARDS

            deadline = time.monotonic() + 60
            while not await both_serving():
                assert time.monotonic() < deadline, "the killed shard did not come back"
                await asyncio.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        samples = await http.metrics()
        assert total(samples, "hkgw_shard_restarts_total") == 1
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, 0)
            raise AssertionError(f"the wedged shard {stopped} still runs")


def _logged(process: GatewayProcess, event: str) -> bool:
    return any(r.get("event") == event for r in process.logs)
