"""Reading a NATS ``.creds`` file before connecting, so a bad one fails with a clear reason.

nats-server answers every refused login with the same ``Authorization Violation``: an expired
JWT, a wrong seed and an unknown account look alike from the client. What can be told from the
file itself (missing, unreadable, not a creds file, expired) is told here, before connecting.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nats.errors

from mesh.config import NatsSettings
from protocol.errors import UnauthorizedError

_JWT = re.compile(r"-----BEGIN NATS USER JWT-----\s*([A-Za-z0-9_.=-]+)\s*-+END NATS USER JWT")


def jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; this is for messages)."""
    try:
        payload = token.split(".")[1]
        return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
    except (IndexError, ValueError) as exc:
        raise ValueError(f"not a JWT: {exc}") from None


def check_creds_file(path: str, now: float | None = None) -> dict[str, Any]:
    """The user claims of a creds file; :class:`UnauthorizedError` when it cannot work."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise UnauthorizedError(f"cannot read NATS credentials {path}: {exc.strerror}") from None
    match = _JWT.search(text)
    if match is None:
        raise UnauthorizedError(f"{path} is not a NATS .creds file (no user JWT in it)")
    try:
        claims = jwt_claims(match.group(1))
    except ValueError as exc:
        raise UnauthorizedError(f"{path}: the user JWT cannot be read ({exc})") from None
    expires = claims.get("exp")
    if isinstance(expires, (int, float)) and expires <= (now or time.time()):
        when = datetime.fromtimestamp(expires, tz=timezone.utc).isoformat(timespec="seconds")
        raise UnauthorizedError(
            f"NATS credentials {path} (user {claims.get('name', '?')!r}) expired at {when}; "
            "mint new ones with `mesh creds`"
        )
    return claims


def may_subscribe(claims: dict[str, Any] | None, subject: str) -> bool:
    """Whether a user with these claims (None: no credentials file, so nothing to tell by) may
    subscribe to ``subject``, by its JWT's permissions: every subject it matches allowed, none
    denied. The server decides; this tells ahead what it would refuse."""
    try:
        sub = ((claims or {}).get("nats") or {}).get("sub") or {}
        allow, deny = sub.get("allow") or [], sub.get("deny") or []
        if allow and not any(_covers(str(pattern), subject) for pattern in allow):
            return False
        return not any(_overlaps(str(pattern), subject) for pattern in deny)
    except (AttributeError, TypeError):  # permissions of a shape not known here: say no
        return False


def _covers(pattern: str, subject: str) -> bool:
    """Every subject that ``subject`` (wildcards and all) matches, ``pattern`` matches too."""
    want, have = pattern.split("."), subject.split(".")
    for i, part in enumerate(want):
        if part == ">":
            return len(have) > i
        if i >= len(have) or have[i] == ">" or part not in ("*", have[i]):
            return False
    return len(want) == len(have)


def _overlaps(pattern: str, subject: str) -> bool:
    """Some subject matches both."""
    a, b = pattern.split("."), subject.split(".")
    for i in range(max(len(a), len(b))):
        x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        if ">" in (x, y):
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != y and "*" not in (x, y):
            return False
    return True


def tls_reason(exc: ssl.SSLError) -> str:
    return f"TLS handshake failed ({exc.reason or exc}); check MESH_NATS_TLS_CA_FILE"


def is_auth_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, nats.errors.AuthorizationError) or (
        "authorization violation" in text or "authentication" in text
    )


def connect_options(settings: NatsSettings) -> dict[str, Any]:
    """Credentials and TLS options for nats-py, from the settings that are set."""
    options: dict[str, Any] = {}
    if settings.creds_file:
        options["user_credentials"] = settings.creds_file
    if settings.inbox_prefix:
        options["inbox_prefix"] = settings.inbox_prefix
    if settings.token:
        options["token"] = settings.token
    if settings.user:
        options["user"] = settings.user
        options["password"] = settings.password or ""
    if settings.tls_ca_file or settings.tls_cert_file:
        context = ssl.create_default_context(cafile=settings.tls_ca_file)
        if settings.tls_cert_file:
            context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
        options["tls"] = context
    return options
