"""What an answer reader (:mod:`mesh.reader`) is given to fill its gaps and to check on its
answer's source: the repair and check types, the answer store's repair, and what a repair
raises when what is missing is gone for good."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats.errors

from protocol.errors import MeshError, UnavailableError
from protocol.messages import WireEvent
from protocol.stream import AnswerState

Repair = Callable[[AnswerState], Awaitable[list[WireEvent]]]
"""Fetch what was kept of the answer, given what the reader has; events in their stored order."""
Watch = Callable[[AnswerState], Awaitable[None]]
"""Look after whoever is generating the answer, given what the reader has (see
:meth:`mesh.queue.CloudCall.watch_worker`)."""


ASK_S = 1.0
"""The longest wait for the reply to one repair's ask of a source that answers from memory (an
edge): it answers within milliseconds, so a silence this long means the ask or its reply was
lost (a link gone silent for a while drops what it carried), and the next try goes at once. At
the request timeout, a repair sent into a 2 s silence held the answer back 5 s after it."""


class SourceGone(Exception):
    """Raised by a repair when what the reader lacks is gone for good (an edge that restarted
    or died held what it relayed in its memory only): the answer ends at once in ``error``,
    typed, instead of in the caller's idle timeout, in silence. A repair's other errors are
    tried again later."""

    def __init__(self, error: MeshError) -> None:
        super().__init__(error.message)
        self.error = error


def store_repair(replay: Callable[[str], Awaitable[list[WireEvent]]], subject: str) -> Repair:
    """A repair that reads everything the answer store kept on token ``subject``."""

    async def repair(_state: AnswerState) -> list[WireEvent]:
        try:
            return await replay(subject)
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(f"answer store unreadable: {type(exc).__name__}") from None

    return repair
