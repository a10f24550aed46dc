"""structlog set-up: JSON lines in the service (journald, log shippers), readable console on a TTY."""

from __future__ import annotations

import logging
import sys

import structlog

from gateway.config import LoggingConfig

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(config: LoggingConfig) -> None:
    console = config.format == "console" or (config.format == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[config.level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
