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
