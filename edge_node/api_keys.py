"""API keys on the edge's HTTP API, as ``vllm serve --api-key`` takes them, each naming an app.

The keys file holds one ``<app> <key>`` per line (``#`` starts a comment); ``mesh creds``
writes one per edge. A ``/v1`` request must carry ``Authorization: Bearer <key>``; the key
names its app, whose kept answers (``service_tier: "flex"``) are its own. ``/health``,
``/ready`` and ``/metrics`` stay open, as vLLM leaves them.

The file is read at start (a bad file stops the edge, naming the line) and again whenever it
changes, at most once a second: a key removed stops working without a restart. A file that
turns unreadable or malformed later keeps the keys last read, and says so in the log.
"""

from __future__ import annotations

import hashlib
import os
import time
from contextvars import ContextVar
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from mesh.logs import get_logger
from protocol.errors import InvalidRequestError, UnauthorizedError
from protocol.subjects import is_token

log = get_logger("edge.api_keys")

MIN_KEY_LENGTH = 16
"""Shorter keys are refused: they could be guessed."""
RECHECK_S = 1.0
"""How often, at most, the file is looked at again."""


def parse_keys(text: str, where: str = "keys file") -> dict[str, str]:
    """``{key: app}`` from the file's text; raises ``InvalidRequestError`` naming the line."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise InvalidRequestError(f"{where}, line {number}: expected '<app> <key>'")
        app, key = parts
        if not is_token(app):
            raise InvalidRequestError(f"{where}, line {number}: app {app!r} is not [A-Za-z0-9_-]")
        if len(key) < MIN_KEY_LENGTH:
            raise InvalidRequestError(
                f"{where}, line {number}: the key of {app!r} is shorter than {MIN_KEY_LENGTH}"
            )
        if key in keys:
            raise InvalidRequestError(f"{where}, line {number}: a key listed twice")
        keys[key] = app
    if not keys:
        raise InvalidRequestError(f"{where} lists no key: every request would be refused")
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys of one edge's HTTP API, following the file they are read from."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._apps: dict[bytes, str] = {}
        self._seen: tuple[float, int] | None = None
        self._checked = 0.0
        self._load()  # a bad file at start is the operator's to fix: raise

    def _load(self) -> None:
        stat = self.path.stat()
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequestError(
                f"API keys file {self.path} is not UTF-8 text (byte {exc.start}): save it as UTF-8"
            ) from None
        keys = parse_keys(text, str(self.path))
        # Looked up by digest: a dict lookup on the key itself would compare it byte by byte.
        self._apps = {_digest(key): app for key, app in keys.items()}
        self._seen = (stat.st_mtime, stat.st_size)
        log.info("API keys read", path=str(self.path), apps=sorted(set(self._apps.values())))

    def _follow(self) -> None:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return
        self._checked = now
        try:
            stat = self.path.stat()
            if (stat.st_mtime, stat.st_size) != self._seen:
                self._load()
        except (OSError, InvalidRequestError) as exc:
            log.error("API keys file unreadable: keeping the keys last read", error=str(exc))

    def app_of(self, authorization: str | None) -> str:
        """The app a request's ``Authorization`` header names; ``UnauthorizedError`` if none."""
        self._follow()
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthorizedError(
                "this edge needs an API key: send 'Authorization: Bearer <key>'"
            )
        app = self._apps.get(_digest(key.strip()))
        if app is None:
            raise UnauthorizedError("the API key is not valid here")
        return app


REQUEST_APP: ContextVar[str | None] = ContextVar("mesh_http_app", default=None)
"""The app the request being handled came from (None: the edge takes no keys)."""


def require_keys(keys: ApiKeys) -> Middleware:
    """Middleware: ``/v1`` routes need a valid key; the app it names goes on the request."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not (request.path.startswith("/v1/") or request.path == "/v1"):
            return await handler(request)
        token = REQUEST_APP.set(keys.app_of(request.headers.get("Authorization")))
        try:
            return await handler(request)
        finally:
            REQUEST_APP.reset(token)

    return check
