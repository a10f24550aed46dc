"""What a CPU worker process logs reaches the service's stderr as JSON lines, like the gateway's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_warning_raised_in_a_worker_is_a_json_line() -> None:
    """A palette PNG with byte transparency makes Pillow warn inside the worker that decodes it: the line
    on stderr is JSON (logger py.warnings), and nothing on stderr is plain text."""
    code = textwrap.dedent(
        """
        import asyncio, io
        from PIL import Image
        from edgewire import new_id, pb
        from gateway.dispatch.cpu import CpuStage
        from gateway.ops.metrics import GatewayMetrics
        from service.logs import LoggingConfig, configure_logging
        from tests.inference.pipeline.specs import demo_spec

        def palette_png() -> bytes:
            image = Image.new("P", (32, 32))
            image.putpalette(list(range(256)) * 3)
            out = io.BytesIO()
            image.save(out, format="PNG", transparency=bytes(range(256)))
            return out.getvalue()

        async def main() -> None:
            logging = LoggingConfig(format="json")
            configure_logging(logging)
            stage = CpuStage(1, "process", GatewayMetrics(()), inline_max_requests=0, logging=logging)
            stage.start()
            try:
                data = palette_png()
                image = pb.ImageInput(data=data, format=pb.IMAGE_FORMAT_PNG, width=32, height=32)
                requests = [
                    pb.InferRequest(request_id=new_id(), model_name="image-classifier", image=image)
                    for _ in range(8)
                ]
                prepared = await stage.prepare("image", demo_spec("image-classifier"), requests)
                assert len(prepared.kept) == 8, prepared.rejected
                stage.release(prepared)
            finally:
                stage.close()

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # a plain-text line fails here
    assert any(e.get("logger") == "py.warnings" and "Palette images" in e["event"] for e in events), lines
