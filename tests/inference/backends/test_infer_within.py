"""infer_within: a batch over the model's rows is cut into calls that share the batch's deadline."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inference.backends.base import (
    BackendError,
    BackendHealth,
    InferCall,
    InferResult,
    ModelSpec,
    infer_within,
)
from routing.types import Priority


class RecordingBackend:
    """Answers each call with its input; records the rows and the timeout of each call. ``hold`` makes the
    first call wait until released (the deadline runs out while it waits)."""

    name = "recording"

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.calls: list[tuple[int, float | None]] = []
        self._hold = hold
        self.entered = asyncio.Event()  # set when the first call is in the backend

    async def start(self) -> None:
        return None

    async def infer(self, call: InferCall) -> InferResult:
        self.calls.append((call.inputs["x"].shape[0], call.timeout_s))
        self.entered.set()
        if self._hold is not None and len(self.calls) == 1:
            await self._hold.wait()
        return InferResult(outputs={"y": call.inputs["x"] * 2}, model_version="1")

    def model(self, name: str, version: str = "") -> ModelSpec | None:
        return None

    def health(self) -> BackendHealth:
        return BackendHealth.SERVING

    async def aclose(self) -> None:
        return None


def _call(rows: int, timeout_s: float | None) -> InferCall:
    x = np.arange(rows, dtype=np.float32).reshape(rows, 1)
    return InferCall(model="m", version="", inputs={"x": x}, priority=Priority.BATCH, timeout_s=timeout_s)


async def test_rows_over_the_limit_are_cut_and_joined_in_order() -> None:
    """70 rows at most 32 a call: three calls of 32, 32, 6, outputs joined in row order."""
    backend = RecordingBackend()
    result = await infer_within(backend, _call(70, None), 32)
    assert [rows for rows, _ in backend.calls] == [32, 32, 6]
    np.testing.assert_array_equal(result.outputs["y"][:, 0], np.arange(70, dtype=np.float32) * 2)


async def test_each_piece_gets_the_time_left_not_the_whole_deadline() -> None:
    """The second piece's timeout is what remains of the first's (never the full budget again)."""
    backend = RecordingBackend()
    await infer_within(backend, _call(64, 30.0), 32)
    (_, first), (_, second) = backend.calls
    assert first is not None and second is not None
    assert second < first < 30.0


async def test_no_piece_starts_after_the_deadline() -> None:
    """A first piece that outlasts the deadline: the rest are not sent, the call is DEADLINE_EXCEEDED."""
    hold = asyncio.Event()
    backend = RecordingBackend(hold)
    task = asyncio.create_task(infer_within(backend, _call(96, 0.05), 32))
    await asyncio.wait_for(backend.entered.wait(), 5)
    await asyncio.sleep(0.06)  # lets the 50 ms budget run out (the deadline itself, not a synchronisation)
    hold.set()
    with pytest.raises(BackendError) as raised:
        await task
    assert raised.value.status == "DEADLINE_EXCEEDED"
    assert len(backend.calls) == 1
