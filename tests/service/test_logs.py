"""The service's stderr is JSON lines only: structlog events, standard-library records and Python warnings."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _stderr_of(code: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stderr.splitlines()


def test_numpy_warning_and_stdlib_record_are_json_lines() -> None:
    """A numpy RuntimeWarning and an aiohttp-style stdlib log record come out as JSON objects, not text."""
    lines = _stderr_of(
        """
        import logging
        import numpy as np
        import structlog
        from service.logs import LoggingConfig, configure_logging

        configure_logging(LoggingConfig(format="json", level="info"))
        structlog.get_logger("gateway").info("started", carriers=3)
        np.log(np.zeros(1))  # RuntimeWarning: divide by zero
        logging.getLogger("aiohttp.server").error("Error handling request")
        """
    )
    events = [json.loads(line) for line in lines]  # fails on any plain-text line
    assert events[0]["event"] == "started"
    warning = next(e for e in events if e.get("logger") == "py.warnings")
    assert "RuntimeWarning" in warning["event"]
    assert warning["level"] == "warning"
    record = next(e for e in events if e.get("logger") == "aiohttp.server")
    assert (record["event"], record["level"]) == ("Error handling request", "error")


def test_reload_replaces_the_handler_instead_of_adding_one() -> None:
    """Applying [logging] twice (a SIGHUP) leaves one handler: each record is written once."""
    lines = _stderr_of(
        """
        import logging
        from service.logs import LoggingConfig, LogSettings, configure_logging

        configure_logging(LoggingConfig(format="json"))
        LogSettings(LoggingConfig(format="json")).apply(LoggingConfig(format="json", level="debug"))
        logging.getLogger("grpc").warning("once")
        """
    )
    assert sum(json.loads(line)["event"] == "once" for line in lines) == 1
