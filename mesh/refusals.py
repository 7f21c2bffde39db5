"""What the server refused a connection for its permissions: subscriptions and publishes.

The server says so after the fact, in an ``-ERR`` that nats-py hands to the connection's error
callback (lower-cased), never as the answer to the subscribe or the publish. A request
published where its sender may not publish is dropped there: without this, its sender heard
nothing until its own timeout (60 s for the SDK asking an edge its credentials do not cover,
"JetStream did not ack" for a request queued outside its scope), and took it for a timeout.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import nats.errors

from mesh.round_trip import round_trip
from protocol.errors import UnauthorizedError

_REFUSED = re.compile(
    r'permissions violation for (subscription|publish) to "([^"]+)"', re.IGNORECASE
)


class Refusals:
    def __init__(self) -> None:
        self.subscriptions: set[str] = set()
        """Subjects the server refused a subscription to, lower-cased."""
        self.publishes: set[str] = set()
        """Subjects the server refused a publish to, lower-cased."""
        self._checked: set[str] = set()
        """Subjects a publish to was checked (:meth:`check_publish`)."""
        self._flushes: set[asyncio.Task[None]] = set()

    def heard(self, error: Exception) -> None:
        """Note a refusal the error callback was handed (any other error: nothing)."""
        found = _REFUSED.search(str(error))
        if found is not None:
            kind, subject = found.groups()
            refused = self.subscriptions if kind.lower() == "subscription" else self.publishes
            refused.add(subject.lower())

    def clear(self) -> None:
        """After a reconnect: what the credentials allow now (a rotated file) is heard again."""
        self.subscriptions.clear()
        self.publishes.clear()
        self._checked.clear()

    def publish_refused(self, subject: str, request_id: str | None = None) -> UnauthorizedError:
        return UnauthorizedError(
            f"this connection's credentials may not publish to {subject!r} (the server "
            "refused it): use credentials made for this edge, scope or model",
            request_id=request_id,
        )

    def raise_if_refused(self, subject: str, request_id: str | None = None) -> None:
        if subject.lower() in self.publishes:
            raise self.publish_refused(subject, request_id)

    async def check_publish(
        self, nc: Any, subject: str, timeout: float, request_id: str | None = None
    ) -> None:
        """After a publish to ``subject``: the first time, a round trip to the server, whose
        refusal comes before its answer; raises :class:`UnauthorizedError` when it was
        refused. Later publishes to the same subject cost a set lookup. The round trip is
        never cut short (:mod:`mesh.round_trip`); only the wait for it is."""
        if subject in self._checked:
            self.raise_if_refused(subject, request_id)
            return
        flush = round_trip(nc, self._flushes)
        try:
            await asyncio.wait_for(asyncio.shield(flush), max(timeout, 0.001))
        except (asyncio.TimeoutError, nats.errors.Error):
            return  # no word either way: the request's own wait says what happens
        self._checked.add(subject)
        self.raise_if_refused(subject, request_id)
