"""The Python client SDK.

    async with MeshClient("nats://127.0.0.1:4222") as client:
        async for event in client.stream("Why is the sky blue?"):
            if isinstance(event, TokenEvent):
                print(event.text, end="")
        answer = await client.complete("2+2?", via="cloud")

``via="edge"`` (default) asks an edge node, which routes; ``via="cloud"`` queues the request
for the worker pool directly. Errors arrive as typed :class:`protocol.errors.MeshError`s.
Leaving a stream early (break, cancel) cancels the request.

Every stream is checked with the stream contract (:mod:`protocol.stream`): what the SDK yields
is one gap-free answer. Events missed on the way (a dropped connection, a slow consumer) are
fetched again, from the edge or from the answer store. If an answer has to start over, the SDK
yields a :class:`RestartEvent` first: drop the text received so far. The same ``request_id`` sent
again from one client joins the first request (a new try once it withdrew it: mesh.try_ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import nats.errors
from nats.aio.msg import Msg
from pydantic import ValidationError

from mesh.caller_events import StreamItem, caller_events
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection, request_or_nobody
from mesh.inline_sub import Inboxes
from mesh.lifecycle import Lifecycle
from mesh.queue import WITHDRAW_S, CloudCall, request_too_large
from mesh.reader import AnswerReader
from mesh.repair import Patience, Repair, SourceGone
from mesh.served_models import ServedModels
from mesh.tasks import TaskSet, within_deadline
from mesh.try_ids import TryIds, as_asked
from mesh.write_now import write_queued
from protocol.codec import (
    CONTENT_TYPE,
    WireFormat,
    decode_event,
    dump,
    invalid_request_error,
    to_exception,
)
from protocol.errors import (
    DeadlineExceededError,
    IncompleteAnswerError,
    InvalidRequestError,
    MeshError,
    MeshTimeoutError,
    UnavailableError,
    UnknownModelError,
)
from protocol.messages import (
    Answer,
    ChatMessage,
    EndEvent,
    ErrorEvent,
    InferRequest,
    RestartEvent,
    RouteChoice,
    TokenEvent,
    WireEvent,
    new_request_id,
)
from protocol.stream import AnswerState
from protocol.subjects import (
    DEFAULT_SCOPE,
    edge_answer_subject,
    edge_cancel_subject,
    edge_infer_subject,
    edge_resend_subject,
)

Via = Literal["edge", "cloud"]
EDGE_RESTART_S = 2.0
"""How long a request no edge was subscribed for is sent again (an edge restarting)."""
EDGE_GONE_AFTER_S = 10.0
"""How long an edge nobody answers for may be away mid-request, by default (see MeshClient)."""


@dataclass
class Completion:
    """A whole answer: its text and the end message (path, routing, usage, timings)."""

    text: str
    end: EndEvent
    restarts: int = 0
    events: list[StreamItem] = field(default_factory=list, repr=False)

    @property
    def path(self) -> str:
        return self.end.path


class MeshClient(Lifecycle):
    def __init__(
        self,
        nats_url: str | None = None,
        *,
        edge_id: str | None = None,
        settings: MeshSettings | None = None,
        connection: Connection | None = None,
        first_event_timeout: float = 60.0,
        idle_timeout: float = 60.0,
        pending_limit: int | None = None,
        edge_gone_after: float = EDGE_GONE_AFTER_S,
    ) -> None:
        """``pending_limit``: messages a stream's subscription buffers before NATS drops them
        (a slow consumer); the SDK fetches dropped events again. nats-py's default when None.
        ``edge_gone_after``: how long an edge nobody answers for mid-request may be away (its
        link down) before its answer ends typed (``incomplete``, or ``unavailable`` when none
        had begun): what it relayed lives in its memory only."""
        overrides: dict[tuple[str, ...], Any] = {
            ("nats", "url"): nats_url,
            ("edge", "edge_id"): edge_id,
        }
        self.settings = settings or load_settings(overrides)
        if settings is not None and nats_url is not None:
            self.settings.nats.url = nats_url
        self.edge_id = edge_id or self.settings.edge.edge_id
        self.first_event_timeout = first_event_timeout
        self.idle_timeout = idle_timeout
        self.edge_gone_after = edge_gone_after
        self._own_conn = connection is None
        self.conn = connection or Connection(self.settings.nats, "mesh-client")
        self._pending_limit = pending_limit
        self._secret = secrets.token_bytes(16)
        self._is_served = ServedModels(
            self.conn.jsm, self.settings.stream, no_for=0.0, hear=self.conn
        )
        self._inboxes: Inboxes | None = None
        self._tries = TryIds()
        self._withdrawals = TaskSet("client-withdrawals")  # cloud calls given up (_via_cloud)
        self._open: dict[AnswerReader, Callable[[], Awaitable[None]]] = {}
        """Each call in flight: its reader, and how to take its request back (:meth:`close`)."""
        self._closed = False
        self._closing: asyncio.Future[None] | None = None

    async def connect(self) -> MeshClient:
        if self._closing is not None and not self._closing.done():
            await asyncio.shield(self._closing)  # a close cancelled under its caller ends first
        if self._own_conn:
            await self.conn.connect()
        self._closed, self._closing = False, None  # open again after a close
        return self

    def _replies(self) -> Inboxes:
        """This client's reply inboxes, under a prefix of its own: the edge scopes ids to it."""
        if self._inboxes is None:
            self._inboxes = Inboxes(self.conn.nc.new_inbox())
        return self._inboxes

    @property
    def _timeouts(self) -> tuple[float, float]:
        return self.first_event_timeout, self.idle_timeout

    async def close(self) -> None:
        """Every call in flight ends in :class:`UnavailableError` and its request is taken back
        before the connection closes; closed twice at once, both wait for the one close."""
        self._closed = True
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        calls, self._open = self._open, {}
        for reader in calls:
            reader.end(
                UnavailableError("the client was closed", request_id=reader.state.request_id)
            )
        if calls:
            with contextlib.suppress(asyncio.TimeoutError):  # each is bounded; so are all
                await asyncio.wait_for(
                    asyncio.gather(*(back() for back in calls.values()), return_exceptions=True),
                    WITHDRAW_S,
                )
        await self._withdrawals.close(grace=WITHDRAW_S)  # each is bounded
        await self._is_served.close()
        if self._inboxes is not None:  # its prefix stays: the edge scopes this client's ids to it
            await self._inboxes.close()
        if self._own_conn:
            await self.conn.close()

    def build_request(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | list[ChatMessage] | None = None,
        **fields: Any,
    ) -> InferRequest:
        """Validate a request client-side; :class:`InvalidRequestError` names the bad field."""
        data = {k: v for k, v in fields.items() if v is not None}
        try:
            return InferRequest.model_validate({"prompt": prompt, "messages": messages, **data})
        except ValidationError as exc:
            raise invalid_request_error(exc, data.get("id")) from None

    async def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | list[ChatMessage] | None = None,
        via: Via = "edge",
        route: RouteChoice = "auto",
        model: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.7,
        top_p: float = 1.0,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        deadline: float | None = None,
        request_id: str | None = None,
        deferrable: bool = False,
        cancel_key: str | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """Token events (and a restart event if the answer had to start over), then the end.

        ``deadline`` is absolute (Unix seconds): a request past it is never started, and an
        edge answers locally when too little time is left for the cloud.

        ``deferrable``: the request can wait for the cloud (up to its deadline) instead of being
        answered locally. An edge on a site with its own JetStream holds it through uplink
        outages; if this call ends first, :meth:`answer` fetches the answer later by id, for
        whoever knows the request's ``cancel_key`` (this client's own by default: pass one of
        yours to fetch after a restart). Past its ``deadline`` it is over (no worker starts it):
        for an answer kept beyond this call's wait, give a far deadline, or none.
        """
        if self._closed:
            raise UnavailableError("the client is closed", request_id=request_id)
        if via not in ("edge", "cloud"):
            raise InvalidRequestError(
                f"via is 'edge' or 'cloud', not {via!r}", request_id=request_id
            )
        pool = self.settings.edge.cloud_model if model is None else model  # via the cloud
        if (via == "cloud" or deferrable) and cancel_key is None:  # proof the request is ours
            request_id = new_request_id() if request_id is None else request_id
            cancel_key = self._cancel_key(request_id)
        request = self.build_request(
            prompt,
            messages=messages,
            route=route,
            model=pool if via == "cloud" else model,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            deadline=deadline,
            id=request_id,
            stream=True,
            origin="sdk",
            deferrable=deferrable or None,
            cancel_key=cancel_key,
        )
        source = self._via_cloud(request, pool) if via == "cloud" else self._via_edge(request)
        async with contextlib.aclosing(source):
            try:
                async for event in source:
                    yield event
            except RuntimeError:  # the connection, closed under a call as it began (not_connected)
                if not self._closed:
                    raise
                raise UnavailableError("the client was closed", request_id=request.id) from None

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """The whole answer at once (a restart drops the text gathered before it)."""
        parts: list[str] = []
        events: list[StreamItem] = []
        restarts = 0
        async for event in self.stream(prompt, **kwargs):
            events.append(event)
            if isinstance(event, TokenEvent):
                parts.append(event.text)
            elif isinstance(event, RestartEvent):
                parts.clear()
                restarts += 1
            else:
                return Completion(text="".join(parts), end=event, restarts=restarts, events=events)
        raise RuntimeError("stream ended without an end event")  # _read guarantees one

    async def answer(self, request_id: str, cancel_key: str | None = None) -> Answer:
        """The kept answer of an earlier ``deferrable`` request, from the edge's site; the
        request's ``cancel_key`` proves it is yours (default: this client's own for that id).

        Raises the request's typed error if it failed, and :class:`UnavailableError` (retryable,
        with ``retry_after``) while it has no answer yet."""
        if self._closed:
            raise UnavailableError("the client is closed", request_id=request_id)
        ask = {"id": request_id, "key": cancel_key or self._cancel_key(request_id)}
        try:
            reply = await self.conn.nc.request(
                edge_answer_subject(self.edge_id),
                msgpack.packb(ask),  # its reply comes in msgpack: smaller than JSON
                timeout=self.conn.settings.request_timeout,
                headers={CONTENT_TYPE: WireFormat.MSGPACK.content_type},
            )
        except nats.errors.NoRespondersError:
            raise UnavailableError(f"edge {self.edge_id!r} is not reachable") from None
        except (nats.errors.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(f"asking for the answer failed: {type(exc).__name__}") from None
        event = decode_event(reply.data)
        if isinstance(event, ErrorEvent):
            raise to_exception(event)
        if not isinstance(event, Answer):
            raise UnavailableError(f"the edge answered {event.t!r}, not an answer")
        return event

    def _opened(self, reader: AnswerReader, take_back: Callable[[], Awaitable[None]]) -> None:
        """A call is in flight (:meth:`close` ends it); it may not be once the client closed."""
        if self._closed:
            raise UnavailableError("the client was closed", request_id=reader.state.request_id)
        self._open[reader] = take_back

    def _cancel_key(self, request_id: str) -> str:
        """The same key for the same id from this client: a request sent again can cancel."""
        return hmac.new(self._secret, request_id.encode(), hashlib.sha256).hexdigest()[:32]

    async def _via_edge(self, request: InferRequest) -> AsyncGenerator[StreamItem, None]:
        nc, inboxes = self.conn.nc, self._replies()
        inbox = inboxes.new()
        payload = dump(request, WireFormat.MSGPACK)

        async def send() -> None:
            try:
                subject = edge_infer_subject(self.edge_id)
                # No headers: its first byte says msgpack, and a header cost the edge a parse.
                await nc.publish(subject, payload, reply=inbox)
                write_queued(nc)  # a burst leaves in groups (mesh.write_now)
                # A refused publish (credentials for another edge) is said at once.
                await self.conn.refusals.check_publish(nc, subject, 2.0, request.id)
            except nats.errors.MaxPayloadError:
                raise request_too_large(len(payload), nc.max_payload, request.id) from None
            except nats.errors.Error as exc:  # closed, or its reconnect buffer is full
                raise UnavailableError(
                    f"cannot send to edge {self.edge_id!r}: {type(exc).__name__}",
                    request_id=request.id,
                ) from None

        reader = AnswerReader(
            self.conn,
            AnswerState(request.id),
            self._edge_repair(request.id, inbox, send),
            what=f"edge {self.edge_id!r}",
            pending_limit=self._pending_limit,
            unserved=send,  # an edge restarting: it subscribes again within a moment
            unserved_for=min(EDGE_RESTART_S, self.first_event_timeout),
        )

        async def cancel() -> None:
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(
                    edge_cancel_subject(self.edge_id),
                    json.dumps({"id": request.id, "inbox": inbox}).encode(),
                )

        await reader.subscribe(inbox, inboxes)
        finished = False
        try:
            self._opened(reader, cancel)
            await send()
            async for event in caller_events(reader, request.deadline, *self._timeouts):
                finished = isinstance(event, EndEvent)
                yield event
            finished = True
        except (MeshTimeoutError, DeadlineExceededError):
            raise  # the edge may still be at it: the finally cancels
        except MeshError:
            finished = True  # the edge answered with an error: nothing left to cancel
            raise
        finally:
            if self._open.pop(reader, None) is not None and not finished:  # else close() did
                await cancel()
            await reader.close()

    def _edge_repair(
        self, request_id: str, inbox: str, send: Callable[[], Awaitable[None]]
    ) -> Repair:
        """Ask the edge to send our inbox the events we lack; they arrive on the subscription.
        An edge that does not know the request, when nothing of its answer came, never got it
        (it went out as our link dropped): it is sent again (the edge joins a request sent
        twice into one answer). Anything of the answer came: the edge lost it, a typed error.

        An edge nobody answers for (the server says so twice: :func:`request_or_nobody`) is
        away: its link is down (it keeps its answers meanwhile: the repair tries again), or it
        died, and what it relayed with it. Once nobody has answered for it for ``edge_gone_after``,
        the answer ends typed, not in the idle timeout's silence. Events of the answer that came
        in between show the edge was back: its next absence is timed anew.
        """
        away_since: float | None = None
        away_at, patience = (0, 0), Patience()  # where the answer stood then; the ask's wait

        async def repair(state: AnswerState) -> list[WireEvent]:
            nonlocal away_since, away_at
            payload = {"id": request_id, "inbox": inbox, "attempt": state.attempt}
            payload["seq"] = state.positions
            subject = edge_resend_subject(self.edge_id)
            reply = await patience.run(lambda wait: self._ask_edge(subject, payload, wait))
            begun = state.started or bool(state.held)
            if reply is None:
                now = time.monotonic()
                if away_since is None or away_at != (state.attempt, state.positions):
                    away_since, away_at = now, (state.attempt, state.positions)
                if now - away_since < self.edge_gone_after:
                    raise UnavailableError(f"edge {self.edge_id!r} is not reachable")
                why = f"nobody has answered for edge {self.edge_id!r} for {now - away_since:.0f}s"
                if begun:
                    lost = f"{why}: its answer is lost; retry"
                    raise SourceGone(IncompleteAnswerError(lost, request_id=request_id))
                raise SourceGone(UnavailableError(f"{why}; retry", request_id=request_id))
            away_since = None
            if _knows(reply):
                return []
            if not begun:
                await send()
                return []
            raise SourceGone(
                IncompleteAnswerError(
                    f"edge {self.edge_id!r} no longer knows request {request_id!r} (it "
                    "restarted, or the answer aged out); retry",
                    request_id=request_id,
                )
            )

        return repair

    async def _ask_edge(self, subject: str, payload: dict[str, object], wait: float) -> Msg | None:
        """The edge's reply; None when the server says, twice, that nobody answers for it."""
        data, timeout = json.dumps(payload).encode(), min(self.conn.settings.request_timeout, wait)
        try:
            return await request_or_nobody(self.conn.nc, subject, data, timeout)
        except (nats.errors.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(f"resend failed: {type(exc).__name__}") from None

    async def _via_cloud(
        self, request: InferRequest, model: str
    ) -> AsyncGenerator[StreamItem, None]:
        """``request`` as :meth:`stream` built it: for ``model``, under its cancel key."""
        asked, deadline, finished = request.id, request.deadline, False
        if not await within_deadline(deadline, self._is_served(model), asked):
            raise UnknownModelError(f"no worker pool serves model {model!r}", request_id=asked)
        async with contextlib.AsyncExitStack() as stack:
            request = self._tries.sent_as(request)  # mesh.try_ids: open until the stack closes
            stack.callback(self._tries.closed, asked)
            call = CloudCall(
                self.conn,
                self.settings.stream,
                request,
                scope=self.settings.nats.scope_or(DEFAULT_SCOPE),
                pending_limit=self._pending_limit,
            )

            async def take_back() -> None:  # when the client closes
                self._tries.withdrawn(asked)
                await call.withdraw()

            self._opened(call.reader, take_back)
            try:
                await within_deadline(deadline, stack.enter_async_context(call), asked)
                async for event in caller_events(call.reader, deadline, *self._timeouts):
                    finished = isinstance(event, EndEvent)
                    yield as_asked(event, asked)
            except MeshError as err:
                finished = not isinstance(err, (MeshTimeoutError, DeadlineExceededError))
                err.request_id = asked if err.request_id == request.id else err.request_id
                raise
            finally:
                mine = self._open.pop(call.reader, None) is not None  # else close() took it back
                if mine and not finished and self._tries.alone(asked):  # else another reads on
                    self._tries.withdrawn(asked)  # first: a retry meanwhile is a new try
                    # Awaited (the caller's share of the queue is free when it hears) within
                    # its deadline: past it, the error does not wait for a hung worker's word.
                    withdraw = self._withdrawals.spawn(call.withdraw(), name="withdraw")
                    left = WITHDRAW_S if deadline is None else deadline - time.time()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(asyncio.shield(withdraw), max(0.0, left))

    start = connect
    stop = close


def _knows(reply: Msg) -> bool:
    """Whether an edge's reply to a resend says it knows the request (yes if it does not say)."""
    try:
        return bool(json.loads(reply.data).get("known", True))
    except (ValueError, AttributeError):
        return True
