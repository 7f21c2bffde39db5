"""A nats-py client that drops a message it cannot read instead of stopping to read at all.

nats-server passes on any bytes in a subject, a reply subject and a header block. nats-py (2.16)
decodes the first two and a block's status line as UTF-8 outside any ``try``, and indexes into
a block shorter than ``NATS/1.0`` and a byte (review S27c): the error ends its read loop, and
no reconnect starts until the pings go stale (3 to 4 s here). Meanwhile the connection hears
nothing, and whatever the server wrote to it is lost with the socket. One
``PUB mesh.v1.cancel.\\xff.x`` reached every worker (they all listen to cancels), and one
request to an edge with such a reply subject left that edge deaf: a request sent in those
seconds was never answered (review S27b).

:class:`SafeClient` reads such a message as nats-py would read nothing: it is dropped, counted
(:data:`dropped`) and logged at most once every :data:`LOG_EVERY_S`. A header *value* that is
not UTF-8 was never a problem: nats-py decodes those with ``errors="replace"``.

This leans on two private methods of nats-py's ``Client`` (``_process_headers`` and
``_build_message``), the ones its ``_process_msg`` calls for every message, and builds a
readable message in place as nats-py does (no call more per message: a token's way through an
edge is about 40 us of CPU, and a wrapper's call is a share of it).
``tests/test_safe_client.py`` checks it against the installed nats-py, and
``tests/test_nats_cli_hostile.py`` sends such bytes through a real nats-server.
"""

from __future__ import annotations

import re
import time
from typing import Any

from nats.aio.client import Client

from mesh.logs import get_logger

log = get_logger(__name__)

LOG_EVERY_S = 10.0
"""At most one warning this often, whatever a sender floods the node with."""


class _Unreadable(dict[str, str]):
    """Headers whose status line could not be read: the message is dropped."""


_UNREADABLE = _Unreadable()


class _Dropped:
    count = 0
    logged_at = -LOG_EVERY_S


dropped = _Dropped()
"""Messages dropped so far in this process (``dropped.count``)."""


_BLANK = re.compile(r"\s").search
"""Whether a header name holds whitespace: what ``str.isspace`` says of any of its characters
(an ASCII name's), in one call."""


class SafeClient(Client):
    """Its per-message methods add no call to a message without headers (every token)."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        """nats-py's header lines parse, the same headers out of the same bytes
        (``tests/test_safe_client.py`` compares the two), with one call where nats-py makes
        one per character of each name (``any(c.isspace() for c in key)``): 47 of the 279
        Python calls from a queued request's read to a worker's engine call."""
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if _BLANK(key):
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out

    async def _process_headers(self, headers: Any) -> dict[str, str] | None:
        if not headers:
            return None
        try:
            return await super()._process_headers(headers)
        except Exception:  # not UTF-8, or not a header block at all (`NATS/1.0` alone: review S27c)
            return _UNREADABLE

    def _build_message(
        self,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: dict[str, str] | None,
    ) -> Any:
        if headers is _UNREADABLE:
            _drop(subject, "a header block nats-py cannot read")
            return None
        try:  # as nats-py builds it, in place (no call more per message)
            return self.msg_class(
                subject=subject.decode(),
                reply=reply.decode(),
                data=data,
                headers=headers,
                _client=self,
                _sid=sid,
            )
        except UnicodeDecodeError:
            _drop(subject, "a subject or reply subject that is not UTF-8")
            return None


def _drop(subject: bytes, why: str) -> None:
    dropped.count += 1
    now = time.monotonic()
    if now - dropped.logged_at >= LOG_EVERY_S:
        dropped.logged_at = now
        log.warning(
            "dropped a message nats-py cannot read",
            why=why,
            subject=subject[:200].decode("utf-8", "replace"),
            dropped=dropped.count,
        )
