"""What a gateway says at start about its own config, for an operator who never ran check-config."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from gateway.config import default_section, load_config
from gateway.dispatch.batch_limits import batch_limit_warnings
from gateway.server import Gateway
from gateway.testing import loopback_overrides


async def test_start_logs_each_batch_limit_warning_once(models_dir: Path) -> None:
    """A CPU pool batching 64 requests where image-classifier takes 32: the start logs check-config's
    warnings, each once, at warning level."""
    pools = default_section()["pools"]
    pools["cpu"] = {**pools["cpu"], "max_batch_size": 64}
    config = load_config(environ={}, overrides=loopback_overrides(models_dir, pools=pools))
    expected = batch_limit_warnings(config)
    assert any(
        w.startswith("pools.cpu.max_batch_size: 64, but model image-classifier takes at most 32")
        for w in expected
    ), expected
    gateway = Gateway(config)
    with capture_logs() as logs:
        await gateway.start()
        try:
            started = [e["event"] for e in logs]
        finally:
            await gateway.drain()
            await gateway.aclose()
    warned = [e for e in logs if e["event"] == "pool batches more than a model takes"]
    assert [e["detail"] for e in warned] == expected
    assert {e["log_level"] for e in warned} == {"warning"}
    assert "gateway ready" in started
