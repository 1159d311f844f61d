"""structlog setup: readable console lines by default, one JSON object per line with `json=True`.

Each record goes out in one write with its newline (`WriteLogger`; `PrintLogger` writes the newline
apart), so the records of serve's processes, which share one stderr, do not run into each other.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(*, json: bool = False, level: str = "info") -> None:
    """Configure structlog for this process (idempotent; logs go to stderr).

    Args:
        json (bool): Emit JSON lines instead of console text. Default: ``False``.
        level (str): Minimum level name ("debug", "info", "warning", "error").
    """
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),  # a record and its newline in one write
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **bound):
    """Return a structlog logger bound to `component=name` plus `bound` key/values."""
    return structlog.get_logger().bind(component=name, **bound)
