"""The edge-device tier serves a batch of any size: calls are cut at the model's max_batch_size."""

from __future__ import annotations

from pathlib import Path

from edge_agent.local import LocalTier
from edgewire import new_id, pb
from inference.models.demo import IMAGE_MAX_BATCH, IMAGE_MODEL
from tests.inference.pipeline.test_image import jpeg


async def test_a_batch_over_the_models_maximum_is_served_whole(models_dir: Path) -> None:
    """IMAGE_MAX_BATCH + 8 images in one local batch: every one OK (ONNX Runtime refused the oversized
    call before, answering all of them INTERNAL)."""
    n = IMAGE_MAX_BATCH + 8
    requests = [
        pb.InferRequest(
            request_id=new_id(),
            model_name=IMAGE_MODEL,
            kind=pb.REQUEST_KIND_IMAGE,
            image=pb.ImageInput(data=jpeg(64, 48, seed=i), format=pb.IMAGE_FORMAT_JPEG, width=64, height=48),
        )
        for i in range(n)
    ]
    tier = LocalTier(models_dir)
    await tier.start()
    try:
        responses = await tier.serve(requests)
    finally:
        await tier.aclose()
    assert [r.status for r in responses] == [pb.STATUS_OK] * n, {r.error_message for r in responses}
    assert [r.request_id for r in responses] == [r.request_id for r in requests]
    assert tier.served == n
