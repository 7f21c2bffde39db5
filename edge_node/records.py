"""The edge's record of each request it accepted: who asked, what it sent them, where to.

Request ids are scoped to their sender: the scope of a NATS request is its reply inbox without
the last token (one per client connection), so two clients' ids never collide. Within a scope:

- a request sent again with the same id and the same content joins the first one: it gets the
  events sent so far and the rest as they come (the whole answer again if it finished within
  ``replay_window``);
- a request with the same id and other content gets a typed ``duplicate`` error;
- a client that missed events asks for them again (``resend``), naming its own inbox, and gets
  what it lacks; a cancel must name the inbox too. The inbox is the client's secret: knowing a
  request id is not enough to read or cancel someone else's answer.

Each record keeps the events it passed on (its *log*), and passes each new one to every sink.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.tasks import CancelAt
from mesh.write_batch import CONTENT_TYPE_BLOCKS, Headers, room
from protocol.codec import CONTENT_TYPE, WireFormat, dump, dump_event, dump_token, error_event
from protocol.errors import (
    DuplicateRequestError,
    ErrorCode,
    MeshError,
    OverloadedError,
    PayloadTooLargeError,
    status_of,
)
from protocol.messages import (
    EndEvent,
    ErrorEvent,
    StartEvent,
    TokenEvent,
    WireEvent,
    token_event,
)
from protocol.stream import AnswerState, starts_over

log = get_logger(__name__)
HTTP_SCOPE = "http:"
"""The scope of an HTTP request begins so: one of its own, that no later request, resend or
cancel names (an HTTP client asks again for a request that can wait at the site's store)."""
SERVICE_ERROR = "Nats-Service-Error"
SERVICE_ERROR_CODE = "Nats-Service-Error-Code"
MAX_RECORDS = 10_000
MAX_SINKS = 16
"""Readers one request in flight may have (its sender's re-sends joined to it)."""
EXPIRY_AGAIN_S = 1.0
"""How often an expired request's task is cancelled again while it has not ended."""


class Sink(Protocol):
    """Where a client's events go: a NATS inbox, an HTTP response."""

    streaming: bool

    async def send(self, event: WireEvent) -> None:
        """Pass one event on; raises :class:`MeshError` when the client cannot be reached."""
        ...


class TokenSink(Sink, Protocol):
    """A sink that takes a token without waiting for anything (see :meth:`Record.emit_now`),
    and says so: ``takes_tokens_now`` is true."""

    takes_tokens_now: bool

    def send_now(self, event: TokenEvent) -> None:
        """Pass one token on at once; raises :class:`MeshError` as :meth:`send` does."""
        ...

    def send_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        """:meth:`send_now` for a token without logprobs, from its fields (this request's id):
        no event is built for it (the hot path)."""
        ...


def error_headers(event: ErrorEvent) -> dict[str, str]:
    """The NATS micro error headers (what ``nats req`` shows for an error)."""
    described = f"{event.code}: {event.message}"[:512].replace("\r", " ").replace("\n", " ")
    return {SERVICE_ERROR: described, SERVICE_ERROR_CODE: str(_status(event.code))}


def _status(code: str) -> int:
    try:
        return status_of(ErrorCode(code))
    except ValueError:
        return 500


class NatsSink:
    """A NATS client's inbox: every event (streaming), or one ``answer`` or ``err`` at the end.

    Every event goes through the connection's write batch (:mod:`mesh.write_batch`), written
    together with other answers' events, in order; the first token and every event that is not
    a token never wait (a start, an end, an error, a collected answer). ``on_error``
    learns of each typed error sent (the micro endpoint's error count)."""

    takes_tokens_now = True

    def __init__(
        self,
        conn: Connection,
        inbox: str,
        request_id: str,
        fmt: WireFormat,
        *,
        streaming: bool,
        on_error: Callable[[ErrorEvent], None] | None = None,
    ):
        self.conn = conn
        self._batch = conn.write_batch
        self.inbox = inbox
        self.fmt = fmt
        self.streaming = streaming
        self._headers = {CONTENT_TYPE: fmt.content_type}
        self._block = CONTENT_TYPE_BLOCKS[fmt]
        self._answer = AnswerState(request_id)
        self._tokens = 0
        self._on_error = on_error
        self._error_sent: ErrorEvent | None = None
        """The one reply of a requester, when it was an error (:meth:`send_again`)."""

    async def send(self, event: WireEvent) -> None:
        if isinstance(event, ErrorEvent):
            await self._error(event)
        elif isinstance(event, TokenEvent):
            self.send_now(event)
        elif self.streaming:
            await self._publish(dump_event(event, self.fmt), self._block)
        else:
            self._answer.feed(event)
            whole = self._answer.whole() if isinstance(event, EndEvent) else None
            if isinstance(whole, ErrorEvent):  # an end that did not match its text
                await self._error(whole)
            elif whole is not None:
                await self._whole(dump(whole, self.fmt))

    async def _whole(self, data: bytes) -> None:
        """A requester's one reply. One the server would refuse (larger than its
        ``max_payload``) is the typed error that says so, not a silence until its timeout."""
        limit = room(self.conn.nc)
        if len(data) <= limit:
            await self._publish(data, self._block)
            return
        too_large = PayloadTooLargeError(
            f"the whole answer is {len(data)} bytes, over the {limit} one NATS message can "
            "carry here: ask with stream=true to have it in parts",
            request_id=self._answer.request_id,
        )
        await self._error(error_event(too_large, self._answer.request_id))

    def send_now(self, event: TokenEvent) -> None:
        if not self.streaming:
            self._answer.feed(event)
            return
        self._tokens += 1
        data = dump_event(event, self.fmt)
        first = self._tokens == 1  # never waits, as a worker's
        self._batch.put(self.inbox, data, None, now=first)

    def send_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        if not self.streaming:
            self._answer.feed_token(attempt, seq, text, n)
            return
        self._tokens += 1
        data = dump_token(self._answer.request_id, seq, text, attempt, self.fmt, n)
        self._batch.put(self.inbox, data, None, now=self._tokens == 1)

    async def send_again(self, last: WireEvent) -> None:
        """Publish again, counting nothing, what may have been lost last: streaming, the
        answer's ``last`` event (a client that has it drops it); else the one ``answer`` or
        ``err`` once it was sent (a requester takes the first reply only). Raises
        :class:`MeshError` as :meth:`send` does."""
        event = last if self.streaming else self._error_sent or self._answer.whole()
        if event is None:
            return  # the one reply has not been sent yet: nothing was lost
        headers = (
            {**self._headers, **error_headers(event)}
            if isinstance(event, ErrorEvent)
            else self._block
        )
        data = dump_event(event, self.fmt)
        try:
            await self._publish(data, headers)
        except MeshError:  # an event to this inbox was dropped: the one to send again, maybe
            await self._publish(data, headers)  # the mark is gone: this put goes out

    async def _error(self, event: ErrorEvent) -> None:
        self._error_sent = event
        await self._publish(dump(event, self.fmt), {**self._headers, **error_headers(event)})
        if self._on_error is not None:
            self._on_error(event)

    async def _publish(self, data: bytes, headers: Headers) -> None:
        """At once, through the write batch: after the tokens it holds, in one write with them.
        Raises :class:`MeshError` when an earlier event to this client could not be published
        (a failure of this one the write batch logs, and the next event raises)."""
        self._batch.put(self.inbox, data, headers, now=True)


Logged = WireEvent | tuple[str, int, str, int, int]
"""An event as a record's log keeps it: a token without logprobs as a plain tuple (id, seq,
text, attempt, n). The garbage collector stops tracking a tuple of plain values, so the minute
of answers an edge keeps for replays is not walked, token by token, by every full collection
(each one stops the event loop meanwhile: ``docs/performance.md``)."""


def _logged(event: WireEvent) -> Logged:
    if isinstance(event, TokenEvent) and event.logprobs is None:
        return (event.id, event.seq, event.text, event.attempt, event.n)
    return event


def _event(item: Logged) -> WireEvent:
    if isinstance(item, tuple):
        return token_event(item[0], item[1], item[2], item[3], item[4])
    return item


@dataclass
class Record:
    scope: str
    client_id: str
    fingerprint_of: Callable[[], str]
    """The request's fingerprint, worked out when a request under the same id asks for it."""
    state: AnswerState
    log: list[Logged] = field(default_factory=list)
    """What was passed on, in order (see :data:`Logged`)."""
    sinks: list[Sink] = field(default_factory=list)
    task: asyncio.Task[Any] | None = None
    finished_at: float | None = None
    restarts: int = 0
    """Times the answer passed on had to start over."""
    deferred: bool = False
    """It waits for the cloud at the edge's site (:func:`edge_node.site.wait_ended`)."""
    held: bool = False
    """The site's outbox holds it."""
    cancelled: bool = False
    """Its client's cancel reached it: it is ending (see :meth:`Records.open`)."""
    _expiry: CancelAt | None = field(default=None, init=False, repr=False)

    @property
    def done(self) -> bool:
        return self.state.done

    def expire_at(self, deadline: float) -> None:
        """Cancel :attr:`task` at ``deadline`` (Unix seconds) unless the answer ended by then:
        one bound for every path, whatever it awaits (a local slot, a generation, a store that
        stopped answering)."""
        assert self.task is not None
        self._expiry = CancelAt(self.task, deadline, unless=lambda: self.done, again=EXPIRY_AGAIN_S)

    @property
    def expired(self) -> bool:
        """Its deadline passed before its answer ended: its task was cancelled for it."""
        return self._expiry is not None and self._expiry.expired

    def disarm(self) -> None:
        """The task ended: no cancel for it any more."""
        if self._expiry is not None:
            self._expiry.stop()

    async def emit(self, events: list[WireEvent]) -> None:
        """Pass events on to every sink, in order (a sink that fails is skipped, logged). When an
        answer starts over and every sink has closed for it (an SSE stream cannot take text
        back: it ended in ``incomplete``), nobody reads the rest: the request's task is
        cancelled, and the answer is not made to its end for no one."""
        restarted = False
        for event in events:
            if starts_over(event, self.state.positions):
                self.restarts += 1
                restarted = True
            self.state.feed(event)
            self.log.append(_logged(event))
            for sink in list(self.sinks):
                try:
                    await sink.send(event)
                except MeshError as err:
                    log_unreachable(self.client_id, err)
        if restarted and self.task is not None and not self.state.done and self._unread():
            log.info("nobody reads the answer that started over: stopping it")
            self.cancelled = True
            self.task.cancel()

    def takes_back(self) -> bool:
        """Whether every client of the answer can take text back (an answer starting over):
        NATS clients and whole answers can, an SSE stream cannot (``takes_back`` False)."""
        return all(getattr(s, "takes_back", True) for s in self.sinks)

    def _unread(self) -> bool:
        return bool(self.sinks) and all(getattr(s, "closed", False) for s in self.sinks)

    def can_emit_now(self) -> bool:
        """Whether every sink takes tokens without waiting (:meth:`emit_now` may be used). A
        loop, not ``all()`` over a generator: asked for every token an edge relays."""
        for sink in self.sinks:  # noqa: SIM110
            if not getattr(sink, "takes_tokens_now", False):
                return False
        return True

    def emit_now(self, tokens: list[TokenEvent]) -> None:
        """:meth:`emit` for in-order tokens, when :meth:`can_emit_now`, under this record's id
        (a relay's tokens carry the queue's): nothing waits, so nothing else runs in between
        (a token never starts an answer over)."""
        for token in tokens:
            if token.logprobs is None:
                self.emit_token_now(token.seq, token.text, token.attempt, token.n)
            else:
                self._emit_now(
                    token_event(
                        self.client_id,
                        token.seq,
                        token.text,
                        token.attempt,
                        token.n,
                        token.logprobs,
                    )
                )

    def emit_token_now(self, seq: int, text: str, attempt: int, n: int) -> None:
        """:meth:`emit_now` for one token without logprobs, from its fields: when it is the
        answer's next one (the hot path), no event is built for it."""
        client_id = self.client_id
        if not self.state.take_token(client_id, attempt, seq, text, n):
            self._emit_now(token_event(client_id, seq, text, attempt, n))
            return
        self.log.append((client_id, seq, text, attempt, n))
        for sink in self.sinks:
            try:
                sink.send_token(seq, text, attempt, n)  # type: ignore[attr-defined]  # can_emit_now
            except MeshError as err:
                log_unreachable(client_id, err)

    def _emit_now(self, event: TokenEvent) -> None:
        self.state.feed(event)
        self.log.append(_logged(event))
        for sink in self.sinks:
            try:
                sink.send_now(event)  # type: ignore[attr-defined]  # a TokenSink: can_emit_now
            except MeshError as err:
                log_unreachable(self.client_id, err)

    async def fail(self, error: MeshError) -> None:
        """End in ``error``, unless an outcome was already passed on."""
        await self.emit(self.state.fail(error).out)

    async def attach(self, sink: Sink) -> None:
        """A second sink for the same request: what was sent so far, then the rest live.
        Raises :class:`OverloadedError` when the request already has ``MAX_SINKS`` readers.

        A reader already there on the same inbox (a client that sent its request again) gets
        nothing more: a second one would have every event after it sent twice. A finished
        answer sent again is sent whole, and its reader is one all the same, so that it may ask
        for what it missed of it (a resend names its inbox); the oldest such gives way."""
        inbox = getattr(sink, "inbox", None)
        there = inbox is not None and any(getattr(s, "inbox", None) == inbox for s in self.sinks)
        if there and not self.done:
            return
        if not there:
            if len(self.sinks) >= MAX_SINKS and not self.done:
                raise OverloadedError(
                    f"request id {self.client_id!r} already has {len(self.sinks)} readers here; "
                    "ask again once it is answered",
                    retry_after=1.0,
                    request_id=self.client_id,
                )
            if len(self.sinks) >= MAX_SINKS:
                self.sinks.pop(0)  # the oldest of a finished answer's: nothing more comes to it
            self.sinks.append(sink)
        for item in list(self.log):
            try:
                await sink.send(_event(item))
            except MeshError:
                return

    def last(self) -> WireEvent | None:
        """The last event passed on, if any."""
        return _event(self.log[-1]) if self.log else None

    def lacking(self, attempt: int, positions: int) -> list[WireEvent]:
        """The events a reader that has ``positions`` positions of ``attempt`` lacks."""
        events = (_event(item) for item in self.log)
        return [e for e in events if _lacks(e, attempt, positions)]


def _lacks(event: WireEvent, attempt: int, positions: int) -> bool:
    if isinstance(event, StartEvent):
        return event.attempt > attempt
    if isinstance(event, TokenEvent):
        return event.attempt > attempt or (event.attempt == attempt and event.seq >= positions)
    return True  # the outcome


class Records:
    """Every request the edge accepted, until ``replay_window`` after it finished."""

    def __init__(self, replay_window: float, max_records: int = MAX_RECORDS) -> None:
        self._window = replay_window
        self._max = max_records
        self._records: dict[tuple[str, str], Record] = {}
        self._finished: OrderedDict[tuple[str, str], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def in_flight(self) -> int:
        """Requests still being answered."""
        return sum(1 for r in self._records.values() if r.task is not None)

    def get(self, scope: str, client_id: str) -> Record | None:
        self._expire()
        return self._records.get((scope, client_id))

    def open(
        self, scope: str, client_id: str, fingerprint: Callable[[], str]
    ) -> tuple[Record, bool]:
        """The record for this request, and whether it is new. Raises
        :class:`DuplicateRequestError` when the id is taken by other content in this scope
        (``fingerprint`` gives the request's: called only then, for each of the two)."""
        existing = self.get(scope, client_id)
        if existing is not None and _may_change(existing):
            # Ended, or ending, in an error a new try may not meet (overloaded, unavailable,
            # cancelled, a deadline passed): the same id sent again is that new try, not a
            # replay of it (nor a reader of an answer that is being cancelled).
            del self._records[(scope, client_id)]
            self._finished.pop((scope, client_id), None)
            existing = None
        if existing is not None:
            if existing.fingerprint_of() != fingerprint():
                raise DuplicateRequestError(
                    f"request id {client_id!r} is in use by a different request of yours; "
                    "use a new id",
                    request_id=client_id,
                )
            return existing, False
        record = Record(scope, client_id, fingerprint, AnswerState(client_id))
        self._records[(scope, client_id)] = record
        return record, True

    def since(self, moment: float) -> list[Record]:
        """Records in flight, and those finished at ``moment`` (``time.monotonic()``) or later."""
        return [
            r for r in self._records.values() if r.finished_at is None or r.finished_at >= moment
        ]

    def finished(self, record: Record) -> None:
        key = (record.scope, record.client_id)
        if self._records.get(key) is not record:
            return
        record.finished_at = time.monotonic()
        if record.scope.startswith(HTTP_SCOPE):  # nothing can name it again: kept, it held its
            del self._records[key]  # log and its place among the records NATS clients need
            return
        self._finished[key] = record.finished_at
        self._expire()
        # Worked out now, after the answer: a finished record keeps its fingerprint, not the
        # request it would be made from.
        fingerprint = record.fingerprint_of()
        record.fingerprint_of = lambda: fingerprint

    def _expire(self) -> None:
        """Forget finished records past the window, and the oldest finished ones beyond the
        bound (in-flight records are never forgotten)."""
        now = time.monotonic()
        while self._finished:
            key, finished_at = next(iter(self._finished.items()))
            if now - finished_at <= self._window and len(self._records) <= self._max:
                break
            del self._finished[key]
            self._records.pop(key, None)


def _may_change(record: Record) -> bool:
    """Whether the record ended, or is ending (a cancel, its deadline), in an error that another
    try of the request may not meet."""
    if record.finished_at is None:
        return record.cancelled or record.expired
    outcome = record.state.outcome
    return isinstance(outcome, ErrorEvent) and (
        outcome.retryable or outcome.code in (ErrorCode.CANCELLED, ErrorCode.DEADLINE_EXCEEDED)
    )


def log_unreachable(request_id: str, err: MeshError) -> None:
    log.info("client unreachable", request_id=request_id, error=err.message)
