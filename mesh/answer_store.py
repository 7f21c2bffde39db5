"""The answer store: stream ``MESH_TOK`` keeps every request's events a short while.

Workers publish events with a plain (core) publish on ``mesh.v1.tok.<scope>.<id>``; the stream
captures them as they pass, so the hot path waits for nothing. What the store is for:

- a reader that missed events (a dropped connection, a slow consumer, a server restart) reads
  them back by subject instead of ending with a gap (:meth:`TokenStore.replay`);
- a worker that takes over a request after another one died reads how far the answer got and
  continues it from there;
- a worker whose connection dropped mid-answer checks what the store kept and publishes again
  what it lost;
- a request sent again with the same id gets its stored answer.

Reads use batch direct get (``$JS.API.DIRECT.GET``), served by any replica without a consumer.
A sender under ``mesh creds`` permissions may neither use direct get (its request body, not its
subject, names what to read, so a server cannot limit it to the sender's own answers) nor create
a consumer (JetStream does not check a push consumer's deliver subject: one could deliver the
sender's own events into another sender's subjects). It asks the workers instead, who read the
stream themselves: ``mesh.v1.store.<scope>.<id>`` (:mod:`cloud_node.store_service`), whose scope
is the subject's, so a server that lets the sender publish only there under its own scope keeps
it to its own answers. The answer comes back a page at a time (:class:`Page`), each one reply
that fits the server's max payload, each page asked for from where the last one ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import nats.errors
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.errors import NotFoundError
from nats.js.manager import JetStreamManager

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.provision import ensure_config, placement
from protocol.codec import WireFormat, decode_event, dump, error_event, to_exception
from protocol.errors import (
    BadPayloadError,
    InvalidRequestError,
    MeshError,
    MeshTimeoutError,
    PayloadTooLargeError,
    UnavailableError,
)
from protocol.messages import Answer, ErrorEvent, WireEvent
from protocol.subjects import PREFIX, TOKEN_WILDCARD, addressed, store_read_subject

log = get_logger(__name__)
BATCH = 1024
"""Messages asked for per direct-get batch (an answer has one per coalesced chunk)."""
PAGE_FRAMING = 128
"""Bytes a page spends beyond its events' own (its map, keys and cursor), rounded up."""
EVENT_FRAMING = 5
"""Bytes a page spends per event (a msgpack bin header)."""
MIN_PAGE_BYTES = 1024
"""The smallest page a worker sends, whatever a reader asks for."""
MAX_PAGE_REQUEST = 256
"""The longest page request a worker reads (``{"after": <seq>, "max_bytes": <n>}``)."""
_MAX_SEQ = 2**63 - 1


def answer_stream_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.answer_stream,
        description="mesh: recent answer events, for catching up and for continuing an answer",
        subjects=[TOKEN_WILDCARD],
        retention=api.RetentionPolicy.LIMITS,
        storage=(
            api.StorageType.FILE if settings.answer_storage == "file" else api.StorageType.MEMORY
        ),
        max_age=settings.answer_max_age,
        max_bytes=settings.answer_max_bytes,
        discard=api.DiscardPolicy.OLD,
        allow_direct=True,
        duplicate_window=min(1.0, settings.answer_max_age),  # events carry no msg ids
        num_replicas=settings.answer_replicas or settings.replicas,
        placement=placement(settings),
    )


async def ensure_answer_stream(jsm: JetStreamManager, settings: StreamSettings) -> None:
    """Create or update ``MESH_TOK`` (idempotent; a no-op when the store is turned off)."""
    if settings.answer_storage == "off":
        return
    managed = ("subjects", "max_age", "max_bytes", "discard", "allow_direct", "num_replicas")
    await ensure_config(jsm, answer_stream_config(settings), managed)


@dataclass(frozen=True)
class Page:
    """One reply of the workers' store service: kept events of one answer, in stream order.

    ``last`` is the stream sequence of the last event in it (the ``after`` of the next page's
    request; the request's own ``after`` when it holds none), ``more`` says whether the stream
    held more events of the answer past it when it was read.
    """

    events: list[bytes]
    last: int
    more: bool

    def encode(self) -> bytes:
        return msgpack.packb(  # type: ignore[no-any-return]
            {"t": "page", "events": self.events, "last": self.last, "more": self.more},
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, data: bytes) -> Page:
        """A page from a worker's reply; the typed error it carries is raised, and a reply that
        is neither is :class:`UnavailableError` (a worker of another version: ask again)."""
        try:
            raw = msgpack.unpackb(data, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise UnavailableError(f"unreadable answer store page: {exc}"[:200]) from None
        if isinstance(raw, dict) and raw.get("t") == "err":
            try:
                event = decode_event(data)
            except MeshError:
                event = None
            if isinstance(event, ErrorEvent):
                raise to_exception(event)
        if not isinstance(raw, dict) or raw.get("t") != "page":
            raise UnavailableError("the answer store service answered something else than a page")
        events, last, more = raw.get("events"), raw.get("last"), raw.get("more")
        if not (
            isinstance(events, list)
            and all(isinstance(e, bytes) for e in events)
            and type(last) is int
            and 0 <= last <= _MAX_SEQ
            and type(more) is bool
        ):
            raise UnavailableError("the answer store service answered a malformed page")
        return cls(events, last, more)


def page_request(after: int, max_bytes: int) -> bytes:
    """A reader's request for the page after stream sequence ``after``, of at most ``max_bytes``
    (its own connection's max payload)."""
    return json.dumps({"after": after, "max_bytes": max_bytes}).encode()


def read_page_request(data: bytes, default_bytes: int) -> tuple[int, int]:
    """``(after, max_bytes)`` from a page request (an empty one: the first page); raises a typed
    error for anything else."""
    if not data:
        return 0, default_bytes
    if len(data) > MAX_PAGE_REQUEST:
        raise PayloadTooLargeError(f"a page request has at most {MAX_PAGE_REQUEST} bytes")
    try:
        raw: Any = json.loads(data)
    except (ValueError, RecursionError):
        raise BadPayloadError("a page request is a JSON object") from None
    if not isinstance(raw, dict):
        raise BadPayloadError("a page request is a JSON object")
    after, max_bytes = raw.get("after", 0), raw.get("max_bytes", default_bytes)
    for name, value in (("after", after), ("max_bytes", max_bytes)):
        if type(value) is not int or not 0 <= value <= _MAX_SEQ:
            raise InvalidRequestError(
                f"{name} must be a whole number from 0", details=[{"loc": name, "msg": "bad"}]
            )
    return after, max_bytes


def error_reply(error: MeshError) -> bytes:
    """A typed error in place of a page (what :meth:`Page.decode` raises again)."""
    return dump(error_event(error), WireFormat.MSGPACK)


class AnswerStore:
    """Reads one request's kept events back, in the order the stream stored them."""

    def __init__(
        self, conn: Connection, settings: StreamSettings, *, filtered: bool | None = None
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.enabled = settings.answer_storage != "off"
        self.filtered = conn.settings.least_privilege if filtered is None else filtered
        """Ask the workers' store service instead of reading the stream (the module's note)."""
        self.page_bytes: int | None = None
        """The largest page asked of the store service (default: the connection's max
        payload)."""
        self.on_missing: Callable[[str], None] | None = None
        """Told when the stream is found missing: whoever puts it back (a worker, which then
        calls :meth:`back`). None: nobody does (a worker that stops)."""
        self.missing = False
        """The stream is known to be gone, and is being put back: a publish to it waits for
        no ack (none would come)."""
        self.losses = 0
        """A generation, moved on when the stream is found gone and when it is back: an
        answer under way across either lacks what it published meanwhile, and its publisher
        catches up at its end."""
        self._back = asyncio.Event()

    async def gone(self) -> bool:
        """Whether the answer stream is missing (JetStream says so); :attr:`on_missing` is told.
        Raises when JetStream cannot say now."""
        try:
            await self.conn.jsm().stream_info(self.settings.answer_stream)
        except NotFoundError:
            self._missing(f"{self.settings.answer_stream} is gone: an answer's end got no ack")
            return True
        return False

    def deleted(self, why: str) -> None:
        """JetStream says the stream was deleted (:mod:`mesh.stream_deleted`): the publishes
        waiting for its ack end now, and :attr:`on_missing` is told."""
        self._missing(why)
        self.conn.stream_gone(self.gone)

    def back(self, since: int) -> None:
        """A pass that began when :attr:`losses` read ``since`` put the stream back: its
        publishes wait for acks again, unless it was lost again meanwhile (that pass may have
        run before; the pass after it says so)."""
        if self.losses == since and self._missing_no_more():
            self._back.set()  # those settling go on
            self._back = asyncio.Event()

    async def came_back(self, within: float) -> bool:
        """Wait ``within`` seconds, less when the stream is put back meanwhile (an answer
        settling then goes on at once); whether it was."""
        try:
            await asyncio.wait_for(self._back.wait(), within)
        except asyncio.TimeoutError:
            return False
        return True

    def let_go(self) -> None:
        """Nobody puts the stream back from now on (the worker stops): publishes wait for its
        acks again, and a missing stream is found by the look at a missing ack."""
        self.on_missing = None
        self._missing_no_more()

    def _missing_no_more(self) -> bool:
        """No longer take the stream for missing; whether it was. An answer under way then
        lacks what it sent meanwhile, so its generation moves (caught up at its end)."""
        if not self.missing:
            return False
        self.missing = False
        self.losses += 1
        return True

    def _missing(self, why: str) -> None:
        self.losses += 1
        if self.on_missing is not None:  # someone puts it back
            self.missing = True
            self.on_missing(why)

    async def replay(
        self, subject: str, timeout: float | None = None, silence: float | None = None
    ) -> list[WireEvent]:
        """Every stored event of one answer, by its token ``subject`` (empty when none are kept
        or the store is off). ``silence``: the longest wait for the store's next word within
        ``timeout`` (a reader's repair: its ask or the answer lost, tried again at once).

        Raises :class:`MeshTimeoutError` or :class:`UnavailableError` when the store cannot be
        read now: a caller cannot tell "nothing kept" from "cannot look".
        """
        if not self.enabled:
            return []
        timeout = self.conn.settings.request_timeout if timeout is None else timeout
        events: list[WireEvent] = []
        fetch = self._ask_workers if self.filtered else self._fetch
        try:
            found = await fetch(subject, timeout, silence)
        except nats.errors.ConnectionClosedError:
            raise UnavailableError(
                "NATS connection closed while reading the answer store"
            ) from None
        except nats.errors.Error as exc:  # e.g. the reconnect buffer is full during an outage
            raise UnavailableError(
                f"cannot read the answer store now: {type(exc).__name__}", retry_after=1.0
            ) from None
        for data in found:
            with contextlib.suppress(MeshError):  # a malformed event is dropped, as live
                event = decode_event(data)
                if not isinstance(event, Answer):
                    events.append(event)
        return events

    async def _fetch(self, subject: str, timeout: float, silence: float | None) -> list[bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        found: list[bytes] = []
        seq = 1
        async with self._inbox() as (inbox, sub):
            while True:
                got, pending = await self._batch(
                    inbox, sub, subject, seq, deadline, timeout, silence=silence
                )
                found.extend(data for _seq, data in got)
                if got:
                    seq = got[-1][0] + 1
                if pending <= 0 or not got:
                    return found

    async def read_page(self, subject: str, after: int, limit: int, timeout: float) -> Page:
        """The kept events on ``subject`` past stream sequence ``after``, as many as fit in a
        message of ``limit`` bytes (one direct-get batch at most): what the workers' store
        service answers. Raises :class:`PayloadTooLargeError` when even the first does not fit.
        """
        if not self.enabled:
            return Page([], after, more=False)
        deadline = asyncio.get_running_loop().time() + timeout
        async with self._inbox() as (inbox, sub):
            got, pending = await self._batch(
                inbox, sub, subject, after + 1, deadline, timeout, max_bytes=limit
            )
        events: list[bytes] = []
        size, last = PAGE_FRAMING, after
        for seq, data in got:
            size += len(data) + EVENT_FRAMING
            if size > limit:
                if not events:
                    raise PayloadTooLargeError(
                        f"a kept event of {len(data)} bytes does not fit a page of {limit}"
                    )
                return Page(events, last, more=True)
            events.append(data)
            last = seq
        return Page(events, last, more=pending > 0 and bool(got))

    async def _ask_workers(
        self, subject: str, timeout: float, silence: float | None
    ) -> list[bytes]:
        """Every kept message on token ``subject``, page by page from the workers' store
        service; a page that does not come is a timeout, never a silent gap."""
        address = addressed(subject)
        if address is None or not subject.startswith(f"{PREFIX}.tok."):
            raise InvalidRequestError(f"{subject!r} is not a token subject")
        ask = store_read_subject(*address)
        nc = self.conn.nc
        max_bytes = self.page_bytes or nc.max_payload
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        found: list[bytes] = []
        after = 0
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise MeshTimeoutError(f"the answer store did not answer in {timeout:g}s")
            try:
                wait = left if silence is None else min(left, silence)
                reply = await nc.request(ask, page_request(after, max_bytes), timeout=wait)
            except nats.errors.NoRespondersError:
                raise UnavailableError(
                    "no worker answers for the answer store", retry_after=1.0
                ) from None
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                raise MeshTimeoutError(f"the answer store did not answer in {wait:g}s") from None
            page = Page.decode(reply.data)
            if (page.events and page.last <= after) or (page.more and not page.events):
                raise UnavailableError("the answer store service answered a page out of order")
            found.extend(page.events)
            after = page.last
            if not page.more:
                return found

    @contextlib.asynccontextmanager
    async def _inbox(self) -> Any:
        nc = self.conn.nc
        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox)
        except nats.errors.Error as exc:
            raise UnavailableError(f"cannot read the answer store: {type(exc).__name__}") from None
        try:
            yield inbox, sub
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _batch(  # noqa: PLR0917 - one call's few plain values
        self,
        inbox: str,
        sub: Subscription,
        subject: str,
        seq: int,
        deadline: float,
        timeout: float,
        max_bytes: int = 0,
        silence: float | None = None,
    ) -> tuple[list[tuple[int, bytes]], int]:
        """One batch direct get from stream sequence ``seq``: the messages found (sequence,
        data), and how many more on ``subject`` the stream held past them."""
        request: dict[str, Any] = {"next_by_subj": subject, "seq": seq, "batch": BATCH}
        if max_bytes:
            request["max_bytes"] = max_bytes
        await self.conn.nc.publish(
            f"{self.conn.api_prefix}.DIRECT.GET.{self.settings.answer_stream}",
            json.dumps(request).encode(),
            reply=inbox,
        )
        loop = asyncio.get_running_loop()
        got: list[tuple[int, bytes]] = []
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise MeshTimeoutError(f"the answer store did not answer in {timeout:g}s")
            wait = left if silence is None else min(left, silence)
            try:
                msg = await sub.next_msg(timeout=wait)
            except nats.errors.TimeoutError:
                if wait < left:
                    raise MeshTimeoutError(f"the answer store said nothing for {wait:g}s") from None
                continue  # the loop head raises once the deadline passed
            headers = msg.headers or {}
            status = headers.get("Status")
            if status is None:
                at = headers.get("Nats-Sequence", "")
                after = got[-1][0] + 1 if got else seq
                got.append((int(at) if at.isdigit() else after, msg.data))
                continue
            if status == "404":
                return got, 0
            if status == "204":  # end of this batch
                pending = headers.get("Nats-Num-Pending", "0") or "0"
                return got, int(pending) if pending.isdigit() else 0
            if status == "503":
                raise UnavailableError("no responders: the answer store is not there")
            raise UnavailableError(f"the answer store answered status {status}")
