"""What the server refused a connection for its permissions: subscriptions and publishes.

The server says so after the fact, in an ``-ERR`` that nats-py hands to the connection's error
callback (lower-cased), never as the answer to the subscribe or the publish. A request
published where its sender may not publish is dropped there: without this, its sender heard
nothing until its own timeout (60 s for the SDK asking an edge its credentials do not cover,
"JetStream did not ack" for a request queued outside its scope), and took it for a timeout.

A wait for the answer to a publish (a JetStream ack, a JetStream API call's reply) can be ended
the moment its subject's refusal is heard (:meth:`Refusals.until_refused`): no answer will come.
"""

from __future__ import annotations

import asyncio
import re
import sys
from types import TracebackType
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
        self._waiting: dict[str, set[_UntilRefused]] = {}
        """The waits :meth:`until_refused` ends, by subject (lower-cased)."""

    def heard(self, error: Exception) -> None:
        """Note a refusal the error callback was handed (any other error: nothing); a publish's
        ends the waits for an answer there (:meth:`until_refused`)."""
        found = _REFUSED.search(str(error))
        if found is not None:
            kind, subject = found.groups()
            subject = subject.lower()
            if kind.lower() == "subscription":
                self.subscriptions.add(subject)
                return
            self.publishes.add(subject)
            waits = self._waiting.pop(subject, ())
            # nats-py lower-cases the -ERR and subjects are case-sensitive: where the waits
            # are for subjects that differ in case only, the refused one cannot be told, and
            # their acks or timeouts decide (an accepted publish must not be told refused).
            if len({wait.subject for wait in waits}) == 1:
                for wait in waits:
                    wait.refused()

    def until_refused(self, subject: str, request_id: str | None = None) -> _UntilRefused:
        """``with refusals.until_refused(subject):`` around a wait for the answer to a publish
        to ``subject`` (made in it or before): the wait ends :class:`UnauthorizedError` as soon
        as the server's refusal of a publish there is heard, not at its own timeout. It cancels
        the task waiting, as ``asyncio.timeout`` does (no task or future of its own: the
        answered publish pays a dict entry). Python 3.11 on: 3.10 cannot tell that cancel from
        another (a client's, a shutdown's), so there the wait runs to its own end."""
        return _UntilRefused(self, subject, request_id)

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


class _UntilRefused:
    """:meth:`Refusals.until_refused`'s wait."""

    __slots__ = ("_cancelling", "_cut", "_key", "_refusals", "_request_id", "_task", "subject")

    def __init__(self, refusals: Refusals, subject: str, request_id: str | None) -> None:
        self._refusals, self.subject, self._request_id = refusals, subject, request_id
        self._key = subject.lower()
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cut = False

    def __enter__(self) -> None:
        if sys.version_info < (3, 11):  # no Task.cancelling: the wait runs to its own end
            return
        self._task = asyncio.current_task()
        if self._task is None:
            return  # not in a task: nothing to end
        self._cancelling = self._task.cancelling()
        self._refusals._waiting.setdefault(self._key, set()).add(self)

    def refused(self) -> None:
        """The server refused a publish to the subject: the wait ends (in :meth:`__exit__`)."""
        if self._task is not None and not self._cut:
            self._cut = True
            self._task.cancel()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        waiting = self._refusals._waiting.get(self._key)
        if waiting is not None:
            waiting.discard(self)
            if not waiting:
                del self._refusals._waiting[self._key]
        if not self._cut or self._task is None:
            return
        if sys.version_info >= (3, 11) and self._task.uncancel() > self._cancelling:
            return  # cancelled from outside as well: that cancel goes on
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            raise self._refusals.publish_refused(self.subject, self._request_id) from None
