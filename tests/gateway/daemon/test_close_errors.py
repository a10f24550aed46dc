"""Errors met while the gateway closes are logged with context and counted by reason, never swallowed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gateway.config import load_config
from gateway.server import Gateway
from gateway.testing import loopback_overrides, wait_for
from inference.backends.base import BackendHealth
from tests.gateway.daemon.test_dispatch import backend, split_backends


def close_errors(gw: Gateway, component: str, reason: str) -> float | None:
    labels = {"component": component, "reason": reason}
    return gw.metrics.registry.get_sample_value("hkgw_close_errors_total", labels)


async def test_a_backend_that_fails_to_close_is_logged_and_counted(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend whose aclose raises: logged with its name and error, counted, the other backend closed."""
    gw = Gateway(
        load_config(environ={}, overrides=loopback_overrides(models_dir, **split_backends(models_dir)))
    )
    await gw.start()
    stuck = backend(gw, "gpu")

    async def refuse() -> None:
        raise RuntimeError("socket stuck")

    monkeypatch.setattr(stuck, "aclose", refuse)
    with capture_logs() as logs:
        await gw.drain()
        await gw.aclose()
    await stuck.inner.aclose()
    failed = [e for e in logs if e["event"] == "backend close failed"]
    assert [(e["backend"], str(e["exc_info"])) for e in failed] == [("gpu", "socket stuck")]
    assert close_errors(gw, "gpu", "backend_close_failed") == 1.0
    assert backend(gw, "embedded").inner.health() is BackendHealth.NOT_SERVING  # closed all the same


async def test_a_background_task_that_had_died_is_logged_and_counted_at_close(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The health loop dying on an error is not lost when close reaps it: logged with the task's name and
    the error, counted as task_failed."""
    gw = Gateway(
        load_config(environ={}, overrides=loopback_overrides(models_dir, **split_backends(models_dir)))
    )
    await gw.start()
    health_task = next(t for t in asyncio.all_tasks() if t.get_name() == "health")
    probed = backend(gw, "gpu")
    original = probed.health

    def broken() -> BackendHealth:
        raise RuntimeError("health probe bug")

    monkeypatch.setattr(probed, "health", broken)
    await wait_for(health_task.done, what="the health loop died")
    monkeypatch.setattr(probed, "health", original)
    with capture_logs() as logs:
        await gw.drain()
        await gw.aclose()
    failed = [e for e in logs if e["event"] == "background task had failed"]
    assert [(e["task"], str(e["exc_info"])) for e in failed] == [("health", "health probe bug")]
    assert close_errors(gw, "health", "task_failed") == 1.0


async def test_a_background_task_that_dies_is_logged_and_counted_when_it_dies(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The health loop dying is reported at once (log line, hkgw_background_task_failures_total), while the
    gateway still runs, not first when it closes hours later."""
    gw = Gateway(
        load_config(environ={}, overrides=loopback_overrides(models_dir, **split_backends(models_dir)))
    )
    await gw.start()
    try:
        health_task = next(t for t in asyncio.all_tasks() if t.get_name() == "health")
        probed = backend(gw, "gpu")
        original = probed.health

        def broken() -> BackendHealth:
            raise RuntimeError("health probe bug")

        def failures(task: str) -> float | None:
            return gw.metrics.registry.get_sample_value("hkgw_background_task_failures_total", {"task": task})

        assert (failures("health"), failures("watchdog")) == (0.0, 0.0)  # exported from the start
        with capture_logs() as logs:
            monkeypatch.setattr(probed, "health", broken)
            await wait_for(health_task.done, what="the health loop died")
            await asyncio.sleep(0)  # done callbacks run on the next loop pass
        monkeypatch.setattr(probed, "health", original)
        failed = [e for e in logs if e["event"] == "background task failed"]
        assert [(e["task"], str(e["exc_info"])) for e in failed] == [("health", "health probe bug")]
        assert failures("health") == 1.0
    finally:
        await gw.drain()
        await gw.aclose()
