"""structlog setup, once per entry point: console on a terminal, JSON lines otherwise.

Every line goes through one renderer to one stream: our own lines straight from structlog, the
standard library's (nats-py, aiohttp, asyncio) through structlog's ``ProcessorFormatter``.
Request-scoped fields (``request_id``, ``node_id``, ``subject``, ``trace_id``) are bound with
:class:`bound` and appear on every line logged inside (``structlog.contextvars`` still works
too: its fields are merged the same way).
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, TextIO

import structlog

from mesh.config import LogSettings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(
    settings: LogSettings, stream: TextIO | None = None, *, cache: bool = False
) -> None:
    """Configure structlog and the standard library's logging for this process.

    ``cache``: cache each logger on first use (faster; entry points set it, tests that
    reconfigure logging or capture logs must not).
    """
    stream = stream or sys.stderr
    _Configured.generation += 1
    _Configured.cache = cache
    use_console = settings.format == "console" or (settings.format == "auto" and stream.isatty())
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=stream.isatty())
        if use_console
        else structlog.processors.JSONRenderer(serializer=_json_line)
    )
    shared: list[Any] = [
        merge_bound,
        structlog.contextvars.merge_contextvars,
        add_level_and_time,
        structlog.processors.StackInfoRenderer(),
    ]
    level = _LEVELS[settings.level]
    # Our own lines are rendered and written by structlog itself, not handed to the standard
    # library as records: 24 -> 11 us a line, and a worker writes one per request.
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_SafeWriterFactory(stream),
        cache_logger_on_first_use=cache,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    # Our own lines at the chosen level; other libraries' at warning and above.
    root.setLevel(level)
    for name in ("nats", "aiohttp", "asyncio", "llama_cpp", "httpx", "openai"):
        logging.getLogger(name).setLevel(max(level, logging.WARNING))


# A line's level and time, and its JSON, cost 33 of the 59 us a 15-field line took here through
# structlog's add_log_level, TimeStamper(fmt="iso") and JSONRenderer (json.dumps with a
# ``default`` builds an encoder per call; datetime.isoformat per line): 36 us with these. An edge
# and a worker each write one line per request.
_LEVEL_NAMES = {"warn": "warning", "exception": "error"}
_stamped: tuple[int, str] = (-1, "")
"""The last whole second stamped, and its text (one tuple: a thread never reads half of it)."""


def add_level_and_time(_logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: ``level`` (as ``add_log_level`` names it) and ``timestamp``, UTC,
    ISO 8601 with microseconds (``2026-11-28T09:44:24.817314Z``); a second's text is made once."""
    global _stamped  # noqa: PLW0603
    event_dict["level"] = _LEVEL_NAMES.get(method, method)
    now = time.time()
    second = int(now)
    stamped = _stamped
    if stamped[0] != second:
        stamped = _stamped = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    event_dict["timestamp"] = f"{stamped[1]}.{int((now - second) * 1e6):06d}Z"
    return event_dict


def _unencodable(obj: Any) -> Any:
    """What a line shows of a value JSON has no form for: its ``__structlog__()`` where it has
    one (as structlog's own renderer does), else its repr."""
    as_log = getattr(obj, "__structlog__", None)
    return as_log() if callable(as_log) else repr(obj)


_ENCODER = json.JSONEncoder(default=_unencodable)


def _json_line(event_dict: dict[str, Any], **_dumps_kw: Any) -> str:
    """JSONRenderer's serializer: one encoder for every line (``json.dumps(..., default=)``
    builds one per call)."""
    return _ENCODER.encode(event_dict)


_BOUND: ContextVar[dict[str, Any]] = ContextVar("mesh_log_fields", default={})  # noqa: B039 - never changed


class bound:
    """``with bound(request_id=..., node_id=...):`` puts these fields on every line logged
    inside, in this task and the tasks it starts (an inner ``bound`` adds to an outer one).

    One context variable holding a dict, set once on entry and reset on exit:
    ``structlog.contextvars.bound_contextvars`` sets and resets a variable per field, 7 us
    against 1.3 for four fields (a worker binds four to six), once per request."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self._token: Token[dict[str, Any]] | None = None

    def __enter__(self) -> None:
        outer = _BOUND.get()
        self._token = _BOUND.set({**outer, **self._fields} if outer else self._fields)

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _BOUND.reset(self._token)
            self._token = None


def merge_bound(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: the fields of the innermost :class:`bound`, after the line's own
    (a field the line names itself wins), as ``structlog.contextvars`` merges its fields."""
    for key, value in _BOUND.get().items():
        event_dict.setdefault(key, value)
    return event_dict


class _SafeWriter(structlog.WriteLogger):
    """Writes a rendered line; a line that cannot be written (a closed or broken stream, a full
    disk) is dropped, as the standard library's handlers do: logging never fails a request."""

    def msg(self, message: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().msg(message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class _SafeWriterFactory:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, *_args: Any) -> _SafeWriter:
        return _SafeWriter(self.stream)


# Library manners: until an entry point calls ``configure_logging``, the mesh's lines go to the
# standard library's ``mesh`` logger, which carries only a ``NullHandler``. An application using
# the SDK sees nothing on its stdout or stderr unless it configures logging itself
# (``logging.basicConfig(level=logging.DEBUG)`` shows our lines).
logging.getLogger("mesh").addHandler(logging.NullHandler())

_STD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
}


class _Configured:
    """What :func:`configure_logging` set last: a count of its calls, and whether loggers may be
    cached (a :class:`MeshLogger` then keeps its structlog logger until the next call)."""

    generation = 0
    cache = False


class MeshLogger:
    """A structlog-style logger (``log.info("event", key=value)``) that writes through structlog
    once logging is configured (the CLI and the daemons do that), and through the standard
    library's logger of the same name before (an application using the SDK)."""

    __slots__ = ("_generation", "_logger", "_name", "_std")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: Any = None
        self._generation = -1
        """The configuration :attr:`_logger` was kept under: asking structlog's lazy proxy for
        the logger each line cost 10 of a line's 60 us here."""
        # The SDK's lines sit under ``mesh``, whatever module writes them.
        self._std = logging.getLogger(name if name.startswith("mesh") else f"mesh.{name}")

    def _emit(self, method: str, event: str, fields: dict[str, Any]) -> None:
        if self._generation == _Configured.generation:
            getattr(self._logger, method)(event, **fields)
            return
        if structlog.is_configured():
            # A fresh proxy: one that cached its logger would keep the configuration before.
            logger = structlog.get_logger(self._name).bind()
            if _Configured.cache:
                self._logger, self._generation = logger, _Configured.generation
            getattr(logger, method)(event, **fields)
            return
        level = _STD_LEVELS[method]
        if self._std.isEnabledFor(level):
            text = " ".join([event, *(f"{key}={value}" for key, value in fields.items())])
            self._std.log(level, "%s", text, exc_info=method == "exception")

    def debug(self, event: str, **fields: Any) -> None:
        self._emit("debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit("error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit("exception", event, fields)


def get_logger(name: str) -> MeshLogger:
    return MeshLogger(name)


def trace_id(traceparent: str | None) -> str | None:
    """The trace id of a W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``)."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


_seen_unknown: dict[tuple[str, frozenset[str]], None] = {}
SEEN_UNKNOWN_MAX = 256
"""Field sets remembered as logged (the newest): a client sending new ones with every request
costs a log line each, never memory."""


def log_unknown_fields(kind: str, fields: frozenset[str]) -> None:
    """Tolerant decoding hook: note unknown fields once per message kind and field set (among
    the last :data:`SEEN_UNKNOWN_MAX`)."""
    key = (kind, fields)
    if key not in _seen_unknown:
        if len(_seen_unknown) >= SEEN_UNKNOWN_MAX:
            del _seen_unknown[next(iter(_seen_unknown))]
        _seen_unknown[key] = None
        get_logger(__name__).info("ignoring unknown fields", message=kind, fields=sorted(fields))
