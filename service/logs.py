"""structlog set-up: JSON lines in the service (journald, log shippers), readable console on a TTY.

Everything a program writes to stderr goes through the same renderer: structlog's own events, records of the
standard library's loggers (aiohttp, asyncio, grpc) and Python warnings (numpy's RuntimeWarnings among
them), so a log shipper reading JSON lines never meets a plain-text line.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog
from pydantic import BaseModel, ConfigDict

LogFormat = Literal["auto", "json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]


class LoggingConfig(BaseModel):
    """The ``[logging]`` table of both programs: JSON lines for the service, console on a TTY."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: LogFormat = "auto"
    level: LogLevel = "info"


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


_static: dict[str, object] = {}


def set_static_fields(**fields: object) -> None:
    """Fields every log line of this process carries from now on (a shard's ``shard`` index)."""
    _static.update(fields)


def static_fields() -> dict[str, object]:
    return dict(_static)


def _add_static(_: object, __: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
    for key, value in _static.items():
        event.setdefault(key, value)
    return event


def configure_logging(config: LoggingConfig) -> None:
    console = config.format == "console" or (config.format == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_static,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[config.level]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # one write per line: lines from
        # several processes on one stderr (a front and its shards) never interleave within a line
        cache_logger_on_first_use=False,
    )
    _route_standard_logging(renderer, _LEVELS[config.level])


_handler: logging.Handler | None = None  # the one root handler this module installed


def _route_standard_logging(renderer: structlog.types.Processor, level: int) -> None:
    """Render standard-library log records and Python warnings like structlog's events, on stderr.

    Only the handler installed here is replaced on a reload; handlers others put on the root logger (a
    test runner's) stay.
    """
    global _handler  # noqa: PLW0603 - one process-wide logging set-up, replaced as a whole on reload
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(level)
    _handler = handler
    logging.captureWarnings(True)


class LogSettings:
    """The logging configuration in force (as the command line set it up); a reload applies another one,
    and only when it differs."""

    def __init__(self, current: LoggingConfig) -> None:
        self.current = current

    def apply(self, config: LoggingConfig) -> bool:
        """Reconfigure to ``config`` if it differs; True when it did."""
        if config == self.current:
            return False
        configure_logging(config)
        self.current = config
        return True
