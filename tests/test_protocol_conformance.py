"""docs/PROTOCOL.md against the code and a running gateway: every refusal reason its tables list is produced
by some input, as the tables say it is answered, and none the code can produce is missing from them.

The tables are read from the document itself, so a row added, removed or changed there is checked here.
"""

from __future__ import annotations

import ast
import contextlib
import random
import re
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnx
import pytest
import zmq.auth
from google.protobuf import text_format
from google.protobuf.message import DecodeError
from onnx import TensorProto, helper

from edgewire import FrameCodec, labels, new_id, now_unix_us, pb
from edgewire.errors import REJECT_LABELS, reject_label
from edgewire.ids import id_from_parts
from edgewire.pb.triton import model_config_pb2
from gateway.config import default_section, load_config
from gateway.ingest import _REJECT_NACKS
from gateway.ingress.auth import write_keypair
from gateway.server import Gateway
from gateway.testing import WireClient, fresh_requests, loopback_overrides, run_gateway, wait_for
from inference.models.demo import write_demo_repository
from inference.pipeline.registry import REJECT_LABELS as INPUT_REJECT_LABELS
from inference.pipeline.tensor import InvalidInput, tensor_from_array
from routing.config import DEFAULT_ROUTING_SECTION
from routing.types import REJECT_REASONS, Reason
from tests.gateway.daemon.test_hostile import LIMITS, hostile_kinds

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "PROTOCOL.md"
PRODUCERS = ("edgewire", "gateway", "inference", "routing", "service")
"""The packages whose code refuses frames and requests (the edge agent only reads the reasons)."""
CURVE_ONLY = {"agent_mismatch", "unknown_agent"}
"""Frame refusals that need an authenticated connection: produced by the CURVE test below."""
BUDGET_ONLY = {"over_budget"}
"""Needs an agent over its cost budget: produced and answered by tests/gateway/test_budget.py."""


# ---------------------------------------------------------------------------------------------- the doc


def doc_text() -> str:
    return DOC.read_text()


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def doc_table(marker: str) -> list[dict[str, str]]:
    """The first table after the line starting with ``marker``, one dict per row keyed by its header."""
    lines = doc_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(marker))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    header = _cells(lines[first])
    rows = []
    for line in lines[first + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, _cells(line), strict=True)))
    return rows


def code(cell: str) -> str:
    """The first `quoted` word of a cell."""
    found = re.search(r"`([^`]+)`", cell)
    assert found, cell
    return found.group(1)


def never_sent(cell: str) -> bool:
    return cell.startswith("never")


def nack_rows() -> dict[str, dict[str, str]]:
    return {code(row["NackReason"]): row for row in doc_table("**NackReason**")}


def reject_rows() -> dict[str, dict[str, str]]:
    return {code(row["RejectReason"]): row for row in doc_table("**RejectReason**")}


def sent_reject_labels() -> set[str]:
    return {code(r["label"]) for r in reject_rows().values() if not never_sent(r["raised when"])}


def sent_nacks() -> set[str]:
    return {name for name, row in nack_rows().items() if not never_sent(row["sent when"])}


def answered_with_ack(label: str) -> bool:
    (row,) = [r for r in reject_rows().values() if code(r["label"]) == label]
    return row["answered"].startswith("Ack")


def code_blocks(section: str) -> list[str]:
    """The fenced blocks of one ``## n.`` section, in order."""
    text = doc_text()
    start = text.index(section)
    end = text.find("\n## ", start + 1)
    return re.findall(r"```[a-z]*\n(.*?)```", text[start : end if end > 0 else None], flags=re.S)


def hex_dump(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


# ------------------------------------------------------------------------- tables against the code


def wire_names(enum: Any, prefix: str) -> dict[str, int]:
    return {enum.Name(v).removeprefix(prefix): v for v in enum.values() if v}


def test_nack_table_lists_the_wire_enum() -> None:
    """Every NackReason value is a row with its number and nothing else is; labels as edgewire makes them."""
    rows = nack_rows()
    assert {name: int(row["value"]) for name, row in rows.items()} == wire_names(
        pb.NackReason, "NACK_REASON_"
    )
    assert {name.lower() for name in rows} == set(labels.NACK.values()) - {"unspecified"}


def test_reject_table_lists_the_wire_enum_and_its_labels() -> None:
    """Every RejectReason value is a row with its number and its metric label."""
    rows = reject_rows()
    wire = wire_names(pb.RejectReason, "REJECT_REASON_")
    assert {name: int(row["value"]) for name, row in rows.items()} == wire
    for name, row in rows.items():
        assert code(row["label"]) == reject_label(wire[name])
    assert {code(r["label"]) for r in rows.values()} == set(REJECT_LABELS)
    assert set(REJECT_LABELS) == set(labels.REJECT.values()) - {"unspecified"}


def test_check_order_steps_and_reject_rows_agree() -> None:
    """Section 7's steps and the RejectReason rows name the same step for each reason."""
    steps = {row["step"]: code(row["reject reason"]) for row in doc_table("## 7. Receiver check order")}
    mentioned: dict[str, str] = {}
    for name, row in reject_rows().items():
        for group in re.findall(r"steps? (\d+[a-f]?(?:, \d+[a-f]?)*)", row["raised when"]):
            for step in group.split(", "):
                mentioned[step] = name
    assert mentioned == steps
    never = {name for name, row in reject_rows().items() if never_sent(row["raised when"])}
    assert never.isdisjoint(steps.values())


def test_input_refusal_table_lists_the_pipeline_labels() -> None:
    """Every label a pipeline drops a request with is a row of the input refusals table, and only those."""
    documented = {code(row["label"]) for row in doc_table("**Input refusals.**")}
    assert documented == set(INPUT_REJECT_LABELS) == {label.value for label in InvalidInput}


def referenced_wire_reasons() -> set[str]:
    """Every ``NACK_REASON_*`` / ``REJECT_REASON_*`` name the producing packages' code mentions."""
    found: set[str] = set()
    for package in PRODUCERS:
        for path in (ROOT / package).rglob("*.py"):
            if "pb" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
                if re.fullmatch(r"(NACK|REJECT)_REASON_[A-Z_]+", name) and not name.endswith("UNSPECIFIED"):
                    found.add(name)
    return found


def test_code_sends_exactly_the_reasons_the_doc_says_are_sent() -> None:
    """What the gateway and codec can send is what the tables list as sent; 'never' rows are never named."""
    referenced = referenced_wire_reasons()
    nacks = {n.removeprefix("NACK_REASON_") for n in referenced if n.startswith("NACK_")}
    rejects = {n.removeprefix("REJECT_REASON_").lower() for n in referenced if n.startswith("REJECT_")}
    assert nacks == sent_nacks()
    assert rejects == sent_reject_labels()


def test_each_routing_refusal_is_documented_under_its_nack() -> None:
    """A routing reject reason becomes a nack's detail: the row of that nack names it."""
    rows = nack_rows()
    for reason in REJECT_REASONS:
        nack = pb.NackReason.Name(_REJECT_NACKS[reason]).removeprefix("NACK_REASON_")
        assert f"`{reason.value}`" in rows[nack]["sent when"], (reason, nack)


def test_id_from_parts_layout_is_as_documented() -> None:
    """Section 9's example and bit layout: time, version, rand_a = bits 73-62, variant, rand_b = bits 61-0."""
    text = doc_text()
    example = re.search(r"`id_from_parts\((\d+), (0x[0-9A-Fa-f_]+)\)` is\s+`([0-9a-f-]{36})`", text)
    assert example, "section 9 example"
    ms, bits, expected = int(example.group(1)), int(example.group(2), 16), example.group(3)
    assert str(uuid.UUID(bytes=id_from_parts(ms, bits))) == expected
    rng = random.Random(9)
    for _ in range(200):
        ms, bits = rng.getrandbits(50), rng.getrandbits(80)
        value = int.from_bytes(id_from_parts(ms, bits), "big")
        assert value >> 80 == ms % (1 << 48)
        assert (value >> 76) & 0xF == 7 and (value >> 62) & 0b11 == 0b10
        assert (value >> 64) & 0xFFF == (bits >> 62) & 0xFFF
        assert value & ((1 << 62) - 1) == bits & ((1 << 62) - 1)


def test_worked_example_is_byte_exact_and_names_default_models() -> None:
    """Section 15's code produces the bytes printed there, with models and routing reasons that exist."""
    request_code, envelope_dump, ack_code, ack_dump = code_blocks("## 15. Worked example")
    scope: dict[str, Any] = {}
    exec(request_code, scope)  # the document's own example
    frames = scope["frames"]
    assert hex_dump(frames[0]) == " ".join(envelope_dump.split())
    text = doc_text()
    envelope = pb.Envelope.FromString(frames[0])
    assert f"the {envelope.uncompressed_length}-byte `RequestBatch` as a {len(frames[1])}-byte zstd" in text
    assert f"beginning\n`{hex_dump(frames[1][:10])}`" in text
    exec(ack_code, scope)
    assert hex_dump(scope["ack_frames"][0]) == " ".join(ack_dump.split())
    assert f"payload {len(scope['ack_frames'][1])} bytes" in text
    assert {r.model_name for r in scope["reqs"]} <= set(DEFAULT_ROUTING_SECTION["models"])
    (nack,) = scope["ack"].nacks
    assert _REJECT_NACKS[Reason(nack.detail)] == nack.reason


def test_model_catalogue_lists_the_default_models() -> None:
    """Section 16's table has one row per default routing model, with the pipeline its config names."""
    from inference.models.demo import demo_config

    rows = doc_table("| model | pipeline")
    catalogue = {code(row["model"]): code(row["pipeline, `kind`"]) for row in rows}
    assert set(catalogue) == set(DEFAULT_ROUTING_SECTION["models"])
    for model, pipeline in catalogue.items():
        assert demo_config(model).parameters["pipeline"].string_value == pipeline


# ------------------------------------------------------------------------------ against a gateway


def rejected(gw: Gateway, label: str) -> float:
    labels_ = {"carrier": "hgc", "reason": label}
    return gw.metrics.registry.get_sample_value("hkgw_frames_rejected_total", labels_) or 0.0


def extra_refusals() -> Iterator[tuple[str, list[bytes]]]:
    """Cases the hostile-frame factories do not cover: a skippable zstd frame, control kinds."""
    codec = FrameCodec()
    header, body = codec.encode(pb.RequestBatch(requests=[pb.InferRequest(model_name="x" * 200)]))
    assert pb.Envelope.FromString(header).codec == pb.CODEC_ZSTD
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + b"skip"
    yield "decompression_failed", [header, skippable + body]
    ping_header, ping_body = codec.encode(pb.Ping(nonce=3))
    envelope = pb.Envelope.FromString(ping_header)
    envelope.record_count = 1
    yield "record_count_mismatch", [envelope.SerializeToString(), ping_body]
    envelope.record_count, envelope.codec = 0, 9
    yield "unknown_codec", [envelope.SerializeToString(), ping_body]


async def test_every_frame_refusal_is_produced_and_answered_as_documented(models_dir: Path) -> None:
    """Each documented reason is counted once per frame; an Ack comes back exactly where the table says."""
    factories: dict[str, Callable[[], list[bytes]]] = hostile_kinds()
    cases = [(label, make()) for label, make in factories.items()] + list(extra_refusals())
    assert {label for label, _ in cases} | CURVE_ONLY | BUDGET_ONLY == sent_reject_labels()
    async with (
        run_gateway(models_dir=models_dir, limits=LIMITS) as gw,
        WireClient(gw.endpoint("hgc"), agent_id="conformance") as agent,
    ):
        for label, frames in cases:
            before, acks_before = rejected(gw, label), set(agent.acks)
            await agent.send_raw(frames)
            # A request frame that is not realtime waits for its turn (the backlog: a Ping sent after it may
            # be answered first): the refusal counted first; then replies to one connection keep their
            # order, and an Ack for the refused frame comes before this Pong.
            await wait_for(lambda n=before + 1, r=label: rejected(gw, r) >= n, what=f"{label} counted")
            await agent.ping()
            assert rejected(gw, label) == before + 1, label
            new = {mid: agent.acks[mid] for mid in set(agent.acks) - acks_before}
            try:
                envelope = pb.Envelope.FromString(frames[0])
                is_batch = envelope.kind == pb.MESSAGE_KIND_REQUEST_BATCH
            except DecodeError:  # no envelope at all: nothing can be answered
                envelope, is_batch = None, False
            if answered_with_ack(label) and is_batch:
                assert envelope is not None
                assert list(new) == [envelope.message_id], label
                assert labels.REJECT[new[envelope.message_id].frame_reject] == label
            else:
                assert new == {}, label


def too_many_parameters() -> pb.InferRequest:
    request = pb.InferRequest(request_id=new_id(), model_name="text-encoder", text=pb.TextQuery(text="hi"))
    for i in range(17):
        request.parameters[f"p{i}"] = "v"
    return request


def text_requests(n: int, priority: pb.PriorityClass.ValueType) -> list[pb.InferRequest]:
    deadline = now_unix_us() + 30_000_000
    return [
        pb.InferRequest(
            request_id=new_id(),
            model_name="text-encoder",
            kind=pb.REQUEST_KIND_TEXT,
            priority=priority,
            deadline_unix_us=deadline,
            text=pb.TextQuery(text=f"wireless earbuds {i}", locale="en-US"),
        )
        for i in range(n)
    ]


async def http_get(gw: Gateway, path: str) -> tuple[int, str]:
    assert gw.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{gw.http.port}{path}") as resp,
    ):
        return resp.status, await resp.text()


async def test_every_sent_nack_reason_is_produced_and_draining_is_as_documented(models_dir: Path) -> None:
    """Inputs for each NackReason the table says is sent; the worked example's requests are served; a
    draining gateway answers as section 11 says."""
    seen: set[str] = set()

    def note(ack: pb.Ack) -> None:
        seen.update(pb.NackReason.Name(n.reason).removeprefix("NACK_REASON_") for n in ack.nacks)

    async with run_gateway(models_dir=models_dir) as gw, WireClient(gw.endpoint("hgc")) as agent:
        expired = text_requests(1, pb.PRIORITY_CLASS_INTERACTIVE)[0]
        expired.deadline_unix_us = now_unix_us() - 1_000_000
        bad_id = text_requests(1, pb.PRIORITY_CLASS_INTERACTIVE)[0]
        bad_id.request_id = b"not-a-uuid"
        unknown = text_requests(1, pb.PRIORITY_CLASS_INTERACTIVE)[0]
        unknown.model_name = "no-such-model"
        ack = await agent.wait_ack(await agent.send([expired, bad_id, unknown, too_many_parameters()]))
        note(ack)
        assert [pb.NackReason.Name(n.reason) for n in ack.nacks] == [
            "NACK_REASON_DEADLINE_EXPIRED",
            "NACK_REASON_INVALID_REQUEST",
            "NACK_REASON_UNKNOWN_MODEL",
            "NACK_REASON_INVALID_REQUEST",
        ]
        # REALTIME text fits in the queues of cpu (64) and gpu-a100-mig (32) only: one frame overflows them.
        flood = text_requests(200, pb.PRIORITY_CLASS_REALTIME)
        ack = await agent.wait_ack(await agent.send(flood, priority=pb.PRIORITY_CLASS_REALTIME))
        note(ack)
        assert len(ack.accepted_ids) + len(ack.nacks) == 200 and ack.nacks
        assert {n.reason for n in ack.nacks} == {pb.NACK_REASON_OVERLOADED}
        await agent.wait_responses(list(ack.accepted_ids), timeout_s=60)

        scope: dict[str, Any] = {}
        exec(code_blocks("## 15. Worked example")[0], scope)
        responses = await agent.infer(fresh_requests(scope["reqs"]))
        assert [r.status for r in responses] == [pb.STATUS_OK] * 5, [r.error_message for r in responses]
        assert [[(t.name, list(t.shape)) for t in r.outputs] for r in responses[:4]] == [
            [("item_ids", [5]), ("scores", [5])]
        ] * 4
        assert [(t.name, list(t.shape)) for t in responses[4].outputs] == [("embedding", [64])]

        await gw.drain()
        ack = await agent.wait_ack(await agent.send(text_requests(1, pb.PRIORITY_CLASS_INTERACTIVE)))
        note(ack)
        assert [n.reason for n in ack.nacks] == [pb.NACK_REASON_DRAINING]
        assert (await agent.ping()).draining
        assert await http_get(gw, "/readyz") == (503, "NOT READY draining edge_server=ok cloud=ok\n")
        assert await http_get(gw, "/health/carriers/hgc") == (503, "STATUS:DRAINING gateway draining\n")
        assert await http_get(gw, "/healthz") == (200, "OK\n")
    assert seen == sent_nacks()


def write_tensor_model(root: Path, name: str) -> None:
    """An Identity model of the ``tensor`` pipeline (no pipeline parameter): FP32 [-1] in and out."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.onnx").write_bytes(model.SerializeToString())
    config = model_config_pb2.ModelConfig(name=name, backend="onnxruntime", max_batch_size=8)
    config.input.add(name="x", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    config.output.add(name="y", data_type=model_config_pb2.TYPE_FP32, dims=[-1])
    (root / name / "config.pbtxt").write_text(text_format.MessageToString(config))
    onnx.checker.check_model(model)


def tensor_request(model: str, array: np.ndarray | None, datatype: int | None = None) -> pb.InferRequest:
    request = pb.InferRequest(request_id=new_id(), model_name=model, kind=pb.REQUEST_KIND_TENSOR)
    if array is not None:
        tensor = tensor_from_array("x", array)
        if datatype is not None:
            tensor.datatype = datatype
        request.inputs.append(tensor)
    return request


async def test_every_input_refusal_is_produced_and_tensors_keep_their_batch_dim(tmp_path: Path) -> None:
    """One request per input refusal label, answered INVALID_ARGUMENT `<label>: ...` alone; a valid tensor
    request in the same batch comes back with its own rows."""
    repository = tmp_path / "models"
    write_demo_repository(repository)
    write_tensor_model(repository, "vec-echo")
    routing = default_section()["routing"]
    pools = [dict(p) for p in routing["pools"]]
    pools[0] = {**pools[0], "models": [*pools[0]["models"], "vec-echo"]}
    overrides = {"routing": {"models": {"vec-echo": {"kind": "tensor"}}, "pools": pools}}
    rank = pb.RankingFeatures(candidate_item_ids=[1, 2], candidate_feature_width=2, candidate_dense=[0.0] * 4)
    text = "text-encoder"
    cases = {
        "bad_features": pb.InferRequest(model_name="rank-mlp", kind=pb.REQUEST_KIND_RANKING, ranking=rank),
        "empty_text": pb.InferRequest(model_name=text, kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery()),
        "bad_image": pb.InferRequest(
            model_name="image-classifier",
            kind=pb.REQUEST_KIND_IMAGE,
            image=pb.ImageInput(data=b"not a jpeg", format=pb.IMAGE_FORMAT_JPEG, width=8, height=8),
        ),
        "size_mismatch": pb.InferRequest(
            model_name="image-classifier",
            kind=pb.REQUEST_KIND_IMAGE,
            image=pb.ImageInput(data=b"\0" * 10, format=pb.IMAGE_FORMAT_RAW_RGB8, width=8, height=8),
        ),
        "too_large": pb.InferRequest(
            model_name=text, kind=pb.REQUEST_KIND_TEXT, text=pb.TextQuery(text="a" * 16_385)
        ),
        "missing_input": tensor_request("vec-echo", None),
        "bad_tensor": tensor_request("vec-echo", np.zeros((1, 3), np.float32), pb.DATA_TYPE_INT32),
    }
    valid = tensor_request("vec-echo", np.arange(6, dtype=np.float32).reshape(2, 3))
    ragged = tensor_request("vec-echo", np.zeros((1, 5), np.float32))
    # section 5: the model's pipeline decides what is read, whatever the request's kind says
    wrong_kind = pb.InferRequest(model_name=text, kind=pb.REQUEST_KIND_RANKING, ranking=rank)
    requests = fresh_requests([*cases.values(), valid, ragged, wrong_kind])
    async with (
        run_gateway(models_dir=repository, **overrides) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        responses = await agent.infer(requests)
        counted = {
            label: gw.metrics.registry.get_sample_value(
                "hkgw_input_rejected_total", {"model": request.model_name, "reason": label}
            )
            for label, request in cases.items()
        }
    by_label = dict(zip([*cases, "valid", "ragged_batch", "wrong_kind"], responses, strict=True))
    for label in [*cases, "ragged_batch"]:
        response = by_label[label]
        assert response.status == pb.STATUS_INVALID_ARGUMENT, (label, response.error_message)
        assert response.error_message.startswith(f"{label}: "), (label, response.error_message)
    assert by_label["wrong_kind"].error_message.startswith("empty_text: ")
    assert by_label["valid"].status == pb.STATUS_OK, by_label["valid"].error_message
    (output,) = by_label["valid"].outputs
    assert (output.name, list(output.shape)) == ("y", [2, 3])
    assert np.frombuffer(output.raw_data, "<f4").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert counted == {label: 2 if label == "empty_text" else 1 for label in cases}  # wrong_kind's too
    assert {*cases, "ragged_batch"} == {code(row["label"]) for row in doc_table("**Input refusals.**")}


@pytest.fixture
def curve_keys(tmp_path: Path) -> dict[str, Path]:
    """A gateway key pair, one allowed agent and a stranger, as `hk-gateway keygen` writes them."""
    _, server = write_keypair(tmp_path / "server", "gateway")
    public, agent = write_keypair(tmp_path / "agent", "edge-1", {"agent-id": "edge-1", "region": "us-west"})
    _, stranger = write_keypair(tmp_path / "stranger", "edge-x", {"agent-id": "edge-x"})
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(public, authorized / public.name)
    return {"server": server, "agent": agent, "stranger": stranger, "authorized": authorized}


@contextlib.asynccontextmanager
async def running(gateway: Gateway) -> AsyncIterator[Gateway]:
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.drain()
        await gateway.aclose()


def curve_of(secret_file: Path, server_secret: Path) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(secret_file)
    server_public, _ = zmq.auth.load_certificate(server_secret)
    assert secret is not None
    return public, secret, server_public


async def test_authenticated_refusals_are_produced_and_answered_as_documented(
    models_dir: Path, curve_keys: dict[str, Path]
) -> None:
    """agent_mismatch and unknown_agent (a key removed while connected) get Acks; a key never allowed is
    refused at the handshake and counted there, not as a frame refusal."""
    security = {
        "mode": "curve",
        "server_secret_key": str(curve_keys["server"]),
        "authorized_agents": str(curve_keys["authorized"]),
    }
    agent_keys = curve_of(curve_keys["agent"], curve_keys["server"])
    # Built as the CLI builds it: a reload reads the same overrides again, the agents directory included.
    overrides = loopback_overrides(models_dir, security=security)
    async with running(Gateway(load_config(environ={}, overrides=overrides), overrides=overrides)) as gw:
        endpoint = gw.endpoint("hgc")
        async with WireClient(endpoint, agent_id="edge-2", curve=agent_keys) as impostor:
            ack = await impostor.wait_ack(await impostor.send(text_requests(1, pb.PRIORITY_CLASS_BATCH)))
        assert labels.REJECT[ack.frame_reject] == "agent_mismatch" and answered_with_ack("agent_mismatch")
        async with WireClient(endpoint, agent_id="edge-1", curve=agent_keys) as agent:
            await agent.ping()
            for key in curve_keys["authorized"].glob("*.key"):
                key.unlink()
            # A connection held over budget (gateway/ingress/budget.py) meets the identity checks again after
            # the reload: the step order of section 7 (12, 12a before 13a) holds whatever the budget did.
            assert gw.ingest is not None
            gw.ingest.held.hold("hgc", b"\x00held", "edge-1", time.monotonic() + 60)
            assert gw.reload()
            assert not gw.ingest.held
            ack = await agent.wait_ack(await agent.send(text_requests(1, pb.PRIORITY_CLASS_BATCH)))
        assert labels.REJECT[ack.frame_reject] == "unknown_agent" and answered_with_ack("unknown_agent")
        stranger = curve_of(curve_keys["stranger"], curve_keys["server"])
        async with WireClient(endpoint, agent_id="edge-x", curve=stranger) as outsider:
            await outsider.send(text_requests(1, pb.PRIORITY_CLASS_BATCH))
            labels_ = {"carrier": "hgc", "reason": "auth"}
            await wait_for(
                lambda: gw.metrics.registry.get_sample_value("hkgw_handshake_failures_total", labels_) == 1
            )
        refused = {"reason": "unknown_key"}
        assert gw.metrics.registry.get_sample_value("hkgw_auth_rejected_total", refused) == 1
        assert rejected(gw, "agent_mismatch") == 1 and rejected(gw, "unknown_agent") == 1
