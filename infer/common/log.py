"""structlog setup: a console renderer for people, JSON lines for machines. Never per token."""

from __future__ import annotations

import logging
import sys

import structlog

LEVELS = {  # the level names logging defines -> their numbers
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.FATAL,
    "ERROR": logging.ERROR,
    "WARN": logging.WARN,
    "WARNING": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
    "NOTSET": logging.NOTSET,
}


_settings: tuple[bool, str] | None = None  # what configure() was last given


def settings() -> tuple[bool, str] | None:
    """(json_logs, level) as configure() last set them here, None if never: for a spawned process to set the same."""
    return _settings


def configure(json_logs: bool = False, level: str = "info") -> None:
    global _settings
    _settings = (json_logs, level)
    renderer = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger("infer").bind(**bound)
