"""What a CPU worker process does first: die with the gateway, and log like it.

Workers are forked from the forkserver, which has none of the gateway's logging set up: without this, a
warning raised inside a pipeline (Pillow's on a palette image with transparency, numpy's) would reach the
service's stderr as plain text between its JSON lines.
"""

from __future__ import annotations

from inference.pipeline import worker
from service.logs import LoggingConfig, configure_logging, set_static_fields


def start_worker(logging: LoggingConfig | None, fields: dict[str, object] | None = None) -> None:
    """Worker initializer (picklable with its arguments): parent-death signal, then the gateway's logging
    with its process's static fields (a shard's ``shard``)."""
    worker.die_with_parent()
    set_static_fields(**(fields or {}))
    if logging is not None:
        configure_logging(logging)
