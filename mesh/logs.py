"""structlog setup, once per entry point: console on a terminal, JSON lines otherwise.

Request-scoped fields (``request_id``, ``node_id``, ``subject``) are bound with
``structlog.contextvars.bound_contextvars`` and appear on every line logged inside.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from mesh.config import LogSettings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(settings: LogSettings, stream: TextIO | None = None) -> None:
    """Configure structlog for this process; logs go to ``stream`` (stderr by default)."""
    stream = stream or sys.stderr
    use_console = settings.format == "console" or (settings.format == "auto" and stream.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty())
        if use_console
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[settings.level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # llama.cpp and nats-py log through the standard library; keep them at our level.
    logging.basicConfig(level=max(_LEVELS[settings.level], logging.WARNING), stream=stream)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


_seen_unknown: set[tuple[str, frozenset[str]]] = set()


def log_unknown_fields(kind: str, fields: frozenset[str]) -> None:
    """Tolerant decoding hook: note unknown fields once per message kind and field set."""
    if (kind, fields) not in _seen_unknown:
        _seen_unknown.add((kind, fields))
        structlog.get_logger(__name__).info(
            "ignoring unknown fields", message=kind, fields=sorted(fields)
        )
