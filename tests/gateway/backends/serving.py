"""Test helpers: synthetic requests for one demo model, and serving them as the dispatcher does."""

from __future__ import annotations

from functools import cache

from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from inference.backends.base import Backend, InferCall, InferResult
from inference.pipeline.base import Prepared
from inference.pipeline.registry import pipeline_for
from routing.types import Priority

CACHED = 32
KIND_OF_MODEL = {
    "rank-mlp": pb.REQUEST_KIND_RANKING,
    "text-encoder": pb.REQUEST_KIND_TEXT,
    "image-classifier": pb.REQUEST_KIND_IMAGE,
}


def synthetic(model: str, n: int, seed: int = 0) -> list[pb.InferRequest]:
    """The first n (at most 32) synthetic requests for one demo model, as fresh copies tests may change."""
    assert n <= CACHED, f"at most {CACHED} requests"
    return [pb.InferRequest.FromString(raw) for raw in _synthetic(model, seed)[:n]]


@cache
def _synthetic(model: str, seed: int) -> tuple[bytes, ...]:
    traffic = SyntheticTraffic(seed, n_items=5000, n_users=500, kind_mix=((KIND_OF_MODEL[model], 1.0),))
    return tuple(item.request.SerializeToString() for item in traffic.take(CACHED))


async def serve(
    backend: Backend, requests: list[pb.InferRequest], version: str = ""
) -> tuple[Prepared, list[list[pb.Tensor]], InferResult]:
    """Run requests of one model through its pipeline and the backend, as the dispatcher does."""
    spec = backend.model(requests[0].model_name, version)
    assert spec is not None
    pipeline = pipeline_for(spec.pipeline)
    prepared = pipeline.prepare(requests, spec)
    call = InferCall(spec.name, version, prepared.inputs, Priority.INTERACTIVE, 10.0)
    result = await backend.infer(call)
    return prepared, pipeline.finish(prepared, result.outputs), result
