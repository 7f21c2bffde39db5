"""The id each try of a client's cloud request is queued under.

A request the SDK withdrew from the cloud (its call timed out, was cancelled, or its caller left
the stream) cannot be queued again under its id: the queue drops the copy as a duplicate for
its whole duplicate window (120 s), and the answer store holds the withdrawn try's ``cancelled``.
Sent again from the same client, it got that ``cancelled`` at once, a cancel its caller never
sent, or nothing at all (withdrawn while still queued) until its first-event timeout. After a
withdrawal, the next try of that id goes under an id of its own (the caller's id, a dash and a
random part) and its events are handed back under the caller's id; a try that ended is joined
again under the id it went under, as the same id sent again is."""

from __future__ import annotations

import secrets
from typing import TypeVar

from protocol.messages import InferRequest

_Item = TypeVar("_Item")
REMEMBERED = 10_000
"""Ids remembered at most (the oldest are forgotten first)."""


class TryIds:
    """One client's withdrawn request ids, each with the id its next try goes under."""

    def __init__(self, size: int = REMEMBERED) -> None:
        self._next: dict[str, str] = {}
        self._size = size
        self._open: dict[str, int] = {}
        """The calls under way for each id (a call sent again joins the first, by its id)."""

    def sent_as(self, request: InferRequest) -> InferRequest:
        """``request`` as its try goes to the cloud: as it is, or under its try's own id. Its
        call is open until :meth:`closed`."""
        self._open[request.id] = self._open.get(request.id, 0) + 1
        sent = self._next.get(request.id)
        return request if sent is None else request.model_copy(update={"id": sent})

    def closed(self, request_id: str) -> None:
        left = self._open.pop(request_id, 1) - 1
        if left > 0:
            self._open[request_id] = left

    def alone(self, request_id: str) -> bool:
        """Whether no other call of this client reads the request: one that leaves may withdraw
        it. A call left by a ``break`` is closed a loop turn later (its generator's ``aclose``),
        and the same id sent again at once joins it: withdrawn then, the retry got
        ``cancelled``."""
        return self._open.get(request_id, 0) <= 1

    def withdrawn(self, request_id: str) -> None:
        """The try of the caller's ``request_id`` was withdrawn: the next one goes anew."""
        self._next.pop(request_id, None)
        if len(self._next) >= self._size:
            del self._next[next(iter(self._next))]
        self._next[request_id] = f"{request_id[:100]}-{secrets.token_hex(8)}"


def as_asked(item: _Item, request_id: str) -> _Item:
    """An event of a try, under the id its caller asked with."""
    if getattr(item, "id", request_id) == request_id:
        return item
    return item.model_copy(update={"id": request_id})  # type: ignore[attr-defined,no-any-return]
