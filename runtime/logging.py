"""Structured logging: structlog, console renderer on a terminal, one JSON object per line otherwise.

Logs go to stderr so a command's own output (stdout) stays machine-readable. Loggers carry bound context
(node, actor, request or instance id).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time of the write (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Sets up structlog once for the process. `json=None` picks JSON unless stderr is a terminal."""
    if level not in _LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    use_json = not sys.stderr.isatty() if json is None else json
    renderer: Any = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get_logger(**context: Any) -> Any:
    """A logger with `context` bound to every line it writes. Lazy: it takes the configuration in force when it
    writes, so a module's logger made at import follows `configure_logging` called later (binding the context
    at once would fix the defaults then: stdout, console format, no level)."""
    return structlog.get_logger(**context)
