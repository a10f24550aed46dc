"""The edge-device tier answers as Hong Kong's embedded backend would: the same pipelines and model give
the same outputs, whether a batch is prepared on the event loop (ranking, text) or on the CPU thread."""

from __future__ import annotations

from pathlib import Path

from edge_agent.local import LocalTier
from edge_agent.synthetic import MODEL_RANKING, MODEL_TEXT, SyntheticTraffic
from edgewire import pb
from inference.backends.base import InferCall
from inference.backends.onnx import OnnxBackend, OnnxOptions
from inference.pipeline import worker
from routing.types import Priority


async def reference(models: Path, requests: list[pb.InferRequest]) -> list[bytes]:
    """The gateway's embedded path: requests as wire bytes through prepare, the ONNX backend and finish."""
    backend = OnnxBackend("ref", OnnxOptions.from_mapping("ref", {"repository": str(models)}))
    await backend.start()
    try:
        spec = backend.model(requests[0].model_name)
        assert spec is not None
        prepared = worker.prepare_batch(spec.pipeline, spec, [r.SerializeToString() for r in requests])
        assert not prepared.rejected
        call = InferCall(spec.name, "", prepared.inputs, Priority.REALTIME, None)
        result = await backend.infer(call)
        return worker.finish_batch(spec.pipeline, prepared, result.outputs)
    finally:
        await backend.aclose()


async def test_local_answers_equal_the_gateway_pipelines(models_dir: Path) -> None:
    """Ranking and text batches served locally carry the outputs of the gateway's own path, and the
    requests handed in are left as they were."""
    generated = SyntheticTraffic(8, regions=("us-east",)).take(300)
    tier = LocalTier(models_dir)
    await tier.start()
    try:
        for model in (MODEL_RANKING, MODEL_TEXT):
            requests = [g.request for g in generated if g.request.model_name == model][:8]
            assert len(requests) == 8
            before = [r.SerializeToString() for r in requests]
            responses = await tier.serve(requests)
            assert [r.SerializeToString() for r in requests] == before
            assert [r.status for r in responses] == [pb.STATUS_OK] * len(requests)
            expected = [pb.InferResponse.FromString(b).outputs for b in await reference(models_dir, requests)]
            assert [list(r.outputs) for r in responses] == [list(e) for e in expected]
    finally:
        await tier.aclose()
