"""What an SDK caller gets of an answer's reader (:class:`mesh.reader.AnswerReader`): tokens,
restarts and the end, errors raised, within the caller's timeouts and deadline."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator

from mesh.reader import AnswerReader
from mesh.tasks import CLOCK_SLACK_S
from protocol.codec import to_exception
from protocol.errors import DeadlineExceededError, MeshTimeoutError
from protocol.messages import EndEvent, ErrorEvent, RestartEvent, StartEvent, TokenEvent
from protocol.stream import starts_over

StreamItem = TokenEvent | RestartEvent | EndEvent


async def caller_events(
    reader: AnswerReader, deadline: float | None, first_event_timeout: float, idle_timeout: float
) -> AsyncGenerator[StreamItem, None]:
    """The user-facing events of a reader: tokens, restarts, the end; errors raised.

    ``first_event_timeout`` runs until the first token or outcome (a ``start`` does not
    count: it only says who works on it); ``idle_timeout`` between later events. The
    request's ``deadline`` (Unix seconds) bounds it all: past it, ``deadline_exceeded``,
    whoever was answering (a worker generating on, an edge gone away, nobody).
    """
    clock = asyncio.get_running_loop().time
    ends_at = math.inf if deadline is None else clock() + (deadline - time.time())
    limit = first_event_timeout
    wait_until = clock() + limit
    passed_on = 0
    while True:
        out = await reader.next(max(0.0, min(wait_until, ends_at) - clock()))
        past = clock() >= ends_at - CLOCK_SLACK_S
        # Past the deadline, events held for a slow caller are not passed on, unless the
        # answer's outcome is among them (it ended in time).
        if not out or (past and not reader.state.done):
            if past:
                raise DeadlineExceededError(
                    "the request's deadline passed before its answer ended",
                    request_id=reader.state.request_id,
                )
            raise MeshTimeoutError(
                f"no event from {reader.what} within {limit:g}s "
                f"(waiting for {reader.state.missing()})"
            )
        for moved in out:  # anything but a start: the idle timeout, from now
            if not isinstance(moved, StartEvent):
                limit = idle_timeout
                wait_until = clock() + limit
                break
        for event in out:
            if isinstance(event, TokenEvent):
                passed_on += 1
                yield event
            elif isinstance(event, StartEvent):
                if starts_over(event, passed_on):
                    yield RestartEvent(
                        id=event.id,
                        attempt=event.attempt,
                        reason=event.reason or "the answer started over",
                    )
                    passed_on = event.seq
            elif isinstance(event, EndEvent):
                yield event
                return
            elif isinstance(event, ErrorEvent):
                raise to_exception(event)
