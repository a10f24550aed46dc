"""A batch's OK answers assembled per group: the bytes and the counts are what answering each request on
its own gives, however the batch's slices are ordered."""

from __future__ import annotations

from edgewire import new_id, pb
from gateway.dispatch.work import WorkItem
from gateway.frames.answers import ResponseHeads
from routing.types import Decision, Priority, Reason, Tier


def item(decision: Decision, received: float, enqueued: float) -> WorkItem:
    request = pb.InferRequest(request_id=new_id(), model_name="rank-mlp")
    work = WorkItem(request, "agent", "us-west", "hgc", Priority.REALTIME, received, None, decision, 0)
    work.enqueued = enqueued
    return work


def alone(heads_args: tuple[str, str, pb.ServerTiming, float, float], work: WorkItem, out: bytes) -> bytes:
    """The answer ``work`` gets in a batch of its own."""
    return ResponseHeads(*heads_args).answer(work, work.request.request_id, out)


def test_answers_and_counts_equal_answering_each_request_alone() -> None:
    """Runs of one group, groups interleaved and revisited: every answer's bytes, the responses per (tier,
    pool) and the latency observations are those of each request answered on its own."""
    cloud = Decision(Tier.CLOUD, "gpu-a100", Reason.COMPLEXITY, 0.9, 0.01, 3)
    edge = Decision(Tier.EDGE_SERVER, "cpu", Reason.SPILLOVER_SATURATED, 0.4, 0.02, 1)
    a, b, c = (cloud, 1.0, 1.5), (edge, 1.0, 1.5), (cloud, 1.2, 1.6)  # c: a's decision, another frame
    order = [a, a, a, c, c, b, a, c, b, b, b, b, a, c, c, c, c]
    items = [item(*g) for g in order]
    outputs = [
        pb.InferResponse(outputs=[pb.Tensor(name=f"o{i}")]).SerializeToString() for i in range(len(items))
    ]
    args = ("rank-mlp", "1", pb.ServerTiming(preprocess_us=5, infer_us=7), 2.0, 2.5)
    heads = ResponseHeads(*args)
    answers = [heads.answer(w, w.request.request_id, o) for w, o in zip(items, outputs, strict=True)]
    counts, latencies = heads.totals()
    assert answers == [alone(args, w, o) for w, o in zip(items, outputs, strict=True)]
    for answer, work in zip(answers, items, strict=True):
        parsed = pb.InferResponse.FromString(answer)
        assert parsed.request_id == work.request.request_id
        assert parsed.pool == work.decision.pool and parsed.status == pb.STATUS_OK
    assert counts == {("cloud", "gpu-a100"): 12, ("edge_server", "cpu"): 5}
    assert latencies == {
        ("cloud", "gpu-a100", 2.5 - 1.0): 5,
        ("cloud", "gpu-a100", 2.5 - 1.2): 7,
        ("edge_server", "cpu", 2.5 - 1.0): 5,
    }
