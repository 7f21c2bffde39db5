"""The workers' store service: what the answer store kept of one answer, for a sender that may
not read the stream itself.

A sender under ``mesh creds`` permissions repairs a gap in its answer by asking
``mesh.v1.store.<scope>.<id>`` (core NATS request-reply). Every worker listens, one of them
answers each request (queue group ``mesh-store``), and reads ``mesh.v1.tok.<scope>.<id>`` from
``MESH_TOK`` with its own rights (direct get). The sender creates no consumer and reads no
stream: a server that lets it publish only ``mesh.v1.store.<own scope>.*`` keeps it to its own
answers. What the service trusts:

- the scope and request id come from the subject the request arrived on, never from its body;
- the body says only where to go on from (``after``: a stream sequence) and how large a reply
  the sender can take (``max_bytes``, capped by this worker's own max payload);
- a reply goes to an ordinary inbox only (:func:`protocol.subjects.is_reply_inbox`): a reply
  subject in the mesh's or the server's own space would make the worker write there.

Each request is answered with one message, a page (:class:`mesh.answer_store.Page`): the events
that fit, in stream order, where the last one is, and whether there are more. A long answer is
read in several requests, each from where the last page ended, so a page that does not come is
the reader's timeout, never a silent gap, and each request costs a worker one direct-get batch
at most. A worker answers at most ``MAX_AT_ONCE`` requests at a time; the rest wait their
turn, each scope's in its own line, and a scope with too many waiting is told a retryable
``overloaded``. Failures are typed errors in place of the page.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from functools import partial

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.answer_store import MIN_PAGE_BYTES, AnswerStore, error_reply, read_page_request
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.tasks import cancel_and_wait
from protocol.errors import MeshError, MeshTimeoutError, OverloadedError, UnavailableError
from protocol.subjects import STORE_WILDCARD, addressed, is_reply_inbox, token_subject

log = get_logger(__name__)

QUEUE = "mesh-store"
"""The queue group of every worker's store service: one worker answers each request."""
MAX_AT_ONCE = 64
"""Requests one worker reads for at once; past it, they wait their turn."""
WAITING_PER_SCOPE = 64
"""Requests of one scope that wait their turn, at most; past it, ``overloaded``. Turns go to
the waiting scope with the fewest reads in flight: one edge's flood of reads of its own answers
refused every other edge's repairs (review S20a: 9 or 10 of 10 reads, while a flood of 2,000
went on), and a share per scope refused one edge's own 50 repairs at once (review S20e)."""
BUSY_RETRY_S = 0.2


class StoreService:
    """Answers ``mesh.v1.store.<scope>.<id>`` with what ``MESH_TOK`` kept of that answer."""

    def __init__(self, conn: Connection, store: AnswerStore, *, timeout: float | None = None):
        self.conn = conn
        self.store = store
        """The worker's own reader: direct get, any scope (workers are trusted with it)."""
        self.timeout = conn.settings.request_timeout if timeout is None else timeout
        """How long one page's read of the stream may take."""
        self._busy: set[asyncio.Task[None]] = set()
        self._of_scope: Counter[str] = Counter()  # reads in flight per scope
        self._waiting: dict[str, deque[tuple[str, str, bytes]]] = {}  # per scope, in turn
        self._closed = False
        self.pages = 0
        """Pages sent (typed errors not counted)."""
        self.errors = 0
        """Typed errors sent in place of a page (``overloaded`` included)."""

    async def subscribe(self) -> list[Subscription]:
        # A ``>`` tail, not ``*.*``: a hub passes a leaf node's edge the interest of a wildcard
        # subscription only when the edge's permissions match it (see protocol/subjects.py).
        return [await self.conn.nc.subscribe(STORE_WILDCARD, queue=QUEUE, cb=self._on_request)]

    async def _on_request(self, msg: Msg) -> None:
        address = addressed(msg.subject)
        if address is None or not (msg.reply and is_reply_inbox(msg.reply)):
            return  # nowhere it may answer, or not one answer's subject: nothing is read
        scope = address[0]
        if len(self._busy) < MAX_AT_ONCE:
            self._start(msg.reply, scope, address[1], msg.data)
            return
        if len(self._waiting.get(scope, ())) >= WAITING_PER_SCOPE:
            busy = OverloadedError(
                "the answer store service is busy on this worker", retry_after=BUSY_RETRY_S
            )
            await self._send(msg.reply, error_reply(busy), page=False)
            return
        # Made only to hold a read: an empty line would be given the next turn.
        self._waiting.setdefault(scope, deque()).append((msg.reply, address[1], msg.data))

    def _start(self, reply: str, scope: str, request_id: str, data: bytes) -> None:
        task = asyncio.get_running_loop().create_task(
            self._answer(reply, scope, request_id, data), name="store-read"
        )
        self._busy.add(task)
        self._of_scope[scope] += 1
        task.add_done_callback(partial(self._done, scope))

    def _done(self, scope: str, task: asyncio.Task[None]) -> None:
        self._busy.discard(task)
        self._of_scope[scope] -= 1
        if not self._of_scope[scope]:
            del self._of_scope[scope]
        if self._waiting and not self._closed:  # the next turn: the scope with fewest reads
            turn = min(self._waiting, key=lambda waiting: self._of_scope[waiting])
            queue = self._waiting[turn]
            reply, request_id, data = queue.popleft()
            if not queue:
                del self._waiting[turn]
            self._start(reply, turn, request_id, data)

    async def _answer(self, reply: str, scope: str, request_id: str, data: bytes) -> None:
        own_limit = self.conn.nc.max_payload
        try:
            after, asked = read_page_request(data, own_limit)
            limit = min(max(asked, MIN_PAGE_BYTES), own_limit)
            page = await self.store.read_page(
                token_subject(scope, request_id), after, limit, self.timeout
            )
        except MeshError as exc:
            await self._send(reply, error_reply(exc), page=False)
            return
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            error: MeshError = (
                MeshTimeoutError("the answer store did not answer in time")
                if isinstance(exc, (nats.errors.TimeoutError, asyncio.TimeoutError))
                else UnavailableError(f"cannot read the answer store now: {type(exc).__name__}")
            )
            await self._send(reply, error_reply(error), page=False)
            return
        await self._send(reply, page.encode(), page=True)

    async def _send(self, reply: str, data: bytes, *, page: bool) -> None:
        if page:
            self.pages += 1
        else:
            self.errors += 1
        with contextlib.suppress(nats.errors.Error):
            await self.conn.nc.publish(reply, data)

    async def close(self) -> None:
        self._closed = True
        self._waiting.clear()
        await cancel_and_wait(list(self._busy))
