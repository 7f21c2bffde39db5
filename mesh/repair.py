"""What an answer reader (:mod:`mesh.reader`) is given to fill its gaps, to check on its
answer's source and to pass tokens on: the repair, check and passer types, the answer store's
repair, and what a repair raises when what is missing is gone for good."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import nats.errors

from protocol.errors import MeshError, UnavailableError
from protocol.messages import TokenEvent, WireEvent
from protocol.stream import AnswerState

T = TypeVar("T")
Repair = Callable[[AnswerState], Awaitable[list[WireEvent]]]
"""Fetch what was kept of the answer, given what the reader has; events in their stored order."""
Watch = Callable[[AnswerState], Awaitable[None]]
"""Look after whoever is generating the answer, given what the reader has (see
:meth:`mesh.queue.CloudCall.watch_worker`)."""


ASK_S = 1.0
"""The first wait for the word of a repair's source (an edge answers from memory, the answer
store's next batch comes, within milliseconds): a silence this long means the ask or its reply
was likely lost (a link gone silent for a while drops what it carried), and the next try goes
soon. Waiting the request timeout, a repair sent into a 2 s silence held the answer back 5 s
after it. Each try in a row that gets no word waits twice as long (:class:`Patience`), up to
:data:`MOST_S`: over a link slower than that, a repair still ends."""
MOST_S = 8.0


class Passer(Protocol):
    """Takes tokens on at once, in the subscription's callback, while the reader's caller waits
    in ``AnswerReader.next``, all before them passed on (``AnswerReader.pass_tokens``)."""

    def ready(self) -> bool:
        """Whether tokens can be passed on now, without waiting for anything."""

    def take(self, tokens: list[TokenEvent]) -> None:
        """Pass these tokens on (in order, none seen before); never waits."""

    def take_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        """:meth:`take` for the answer's next token, by its fields (no logprobs, no event)."""


class Patience:
    """How long one reader's repairs wait for their source's word (see :data:`ASK_S`)."""

    def __init__(self) -> None:
        self.wait = ASK_S

    async def run(self, ask: Callable[[float], Awaitable[T]]) -> T:
        """``ask(wait)``; a failure doubles the next wait, a reply sets it back."""
        try:
            result = await ask(self.wait)
        except Exception:
            self.wait = min(self.wait * 2, MOST_S)
            raise
        self.wait = ASK_S
        return result


class SourceGone(Exception):
    """Raised by a repair when what the reader lacks is gone for good (an edge that restarted
    or died held what it relayed in its memory only): the answer ends at once in ``error``,
    typed, instead of in the caller's idle timeout, in silence. A repair's other errors are
    tried again later."""

    def __init__(self, error: MeshError) -> None:
        super().__init__(error.message)
        self.error = error


def store_repair(replay: Callable[..., Awaitable[list[WireEvent]]], subject: str) -> Repair:
    """A repair that reads everything the answer store kept on token ``subject``, waiting for
    its word with :class:`Patience` (``replay``'s ``silence``)."""
    patience = Patience()

    async def repair(_state: AnswerState) -> list[WireEvent]:
        try:
            return await patience.run(lambda wait: replay(subject, silence=wait))
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(f"answer store unreadable: {type(exc).__name__}") from None

    return repair
