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
