"""The compression figures the issue names hold on the synthetic traffic (sizes, not timings)."""

from __future__ import annotations

from bench.compression import measure


def test_batches_and_dictionary_reach_the_targets() -> None:
    """Structured batches of 100 save >= 60 %, single structured messages >= 40 % with the dictionary."""
    rows, envelope_bytes, _ = measure(n_requests=1200, seed=8, train_seed=7)
    by = {(r.traffic, r.shape): r for r in rows}
    structured = "structured (ranking + text)"
    assert by[(structured, "batch of 100")].saved >= 0.60
    assert by[(structured, "single")].saved_dict >= 0.40
    assert by[("ranking", "batch of 100")].saved >= 0.60
    assert by[("image (JPEG)", "single")].saved < 0.2  # JPEG does not shrink; the report must say so
    # What the agent sends by default keeps what compression is worth and sends JPEG bytes as they are.
    assert by[(structured, "batch of 100")].saved_sent >= 0.60
    assert by[(structured, "single")].saved_sent >= 0.40
    jpeg = by[("image (JPEG)", "single")]
    assert jpeg.sent_bytes == jpeg.raw_bytes
    mixed = by[("all kinds", "batch of 100")]
    assert mixed.saved_sent >= mixed.saved_dict - 0.01  # mixed batches are not judged by their JPEG bytes
    assert envelope_bytes < 100
