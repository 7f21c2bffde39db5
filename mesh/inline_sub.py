"""Subscriptions whose messages are handled in the connection's read loop, as they are parsed.

nats-py hands each message of a subscription with a callback to a task of that subscription
through an ``asyncio.Queue``: one more task wake-up per message. For a handler that only files
the message away (an answer reader appends it to its buffer, or passes a token on), that hop is
pure overhead: on a stream of single tokens it is a queue put, a task switch and a queue get per
token. :func:`subscribe_inline` puts the handler in the queue's place, so nats-py calls it from
its read loop for each message, in the order they arrived.

The handler must be synchronous and quick (it holds up the whole connection's reading while it
runs). An exception it raises is logged and the message dropped; it never reaches nats-py's read
loop, which would take the connection down.

This leans on one private attribute of nats-py's ``Subscription`` (``_pending_queue``, which
nats-py's ``_process_msg`` calls ``put_nowait`` on); ``tests/test_inline_sub.py`` checks that
delivery, order, unsubscribe, drain and reconnects still hold with the installed nats-py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.logs import get_logger

log = get_logger(__name__)

Handler = Callable[[Msg], None]


class _Inline:
    """Stands in for a subscription's pending queue: every message put goes to the handler now,
    so nothing is ever pending (no slow consumer can build up here). It holds its subscription
    weakly: the subscription holds it, and a cycle would leave both, and the reader behind the
    handler, to the garbage collector instead of freeing them at the unsubscribe."""

    __slots__ = ("handler", "sub")

    def __init__(self, sub: Subscription, handler: Handler) -> None:
        self.sub = weakref.ref(sub)
        self.handler = handler

    def put_nowait(self, msg: Msg) -> None:
        sub = self.sub()
        if sub is not None:
            sub._pending_size -= len(msg.data)  # counted by nats-py just before the put
        try:
            self.handler(msg)
        except Exception:  # never into nats-py's read loop
            log.exception("inline_handler_failed", subject=msg.subject)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def task_done(self) -> None:
        pass

    async def join(self) -> None:  # Subscription.drain waits for the queue to be handled
        return None


async def subscribe_inline(
    nc: Client, subject: str, handler: Handler, *, queue: str = ""
) -> Subscription:
    """Subscribe to ``subject`` with ``handler`` called for each message in the read loop. The
    subscription behaves like any other for unsubscribe, drain and reconnects."""
    sub = await nc.subscribe(subject, queue=queue)  # no callback: nats-py starts no task
    _install(sub, handler)
    return sub


def make_inline(sub: Subscription, handler: Handler) -> None:
    """Turn a subscription made by someone else with a callback (a micro service's endpoint)
    into an inline one: its task stops, and ``handler`` takes each message in the read loop
    from now on, those already waiting first, in order."""
    waiting = sub._pending_queue
    sub._stop_processing()  # cancels the task that waits on the queue (none is handled there)
    inline = _install(sub, handler)
    while not waiting.empty():
        inline.put_nowait(waiting.get_nowait())


def retarget(sub: Subscription, handler: Handler) -> None:
    """Hand an inline subscription's messages to ``handler`` from now on (a subscription kept
    for another use: a filled pull request's inbox, asked on again)."""
    inline = sub._pending_queue
    if not isinstance(inline, _Inline):
        raise TypeError("not an inline subscription")
    inline.handler = handler


def _install(sub: Subscription, handler: Handler) -> _Inline:
    """Put ``handler`` in the place of ``sub``'s pending queue."""
    inline = _Inline(sub, handler)
    sub._pending_queue = inline  # type: ignore[assignment]
    sub._message_iterator = None  # never iterated; it and the subscription refer to each other
    return inline


class Inboxes:
    """Reply inboxes ``<prefix>.<n>``, all read through one inline subscription to
    ``<prefix>.*``: a request waits on an inbox of its own without a subscription and an
    unsubscription of its own (two protocol lines, the client's bookkeeping for both, and the
    server's interest changes), as nats-py's ``request`` does for its replies. A message for an
    inbox nobody listens on any more is dropped, as the server would have dropped it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._count = itertools.count()
        self._handlers: dict[str, Handler] = {}
        self._nc: Client | None = None
        self._sub: Subscription | None = None
        self._subscribing = asyncio.Lock()

    def new(self) -> str:
        """A fresh inbox under the prefix."""
        return f"{self.prefix}.{next(self._count)}"

    async def listen(self, nc: Client, inbox: str, handler: Handler) -> Listening:
        """Call ``handler`` (in ``nc``'s read loop) for each message to ``inbox`` until the
        returned listening is unsubscribed. The first inbox subscribes to them all (again, for
        a new client)."""
        if self._nc is not nc:
            async with self._subscribing:
                if self._nc is not nc:
                    self._sub = await subscribe_inline(nc, f"{self.prefix}.*", self._on_msg)
                    self._nc = nc
        self._handlers[inbox] = handler
        return Listening(self._handlers, inbox)

    async def close(self) -> None:
        """Unsubscribe (a client that shares its connection leaves no subscription behind)."""
        sub, self._sub, self._nc = self._sub, None, None
        self._handlers.clear()
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def _on_msg(self, msg: Msg) -> None:
        handler = self._handlers.get(msg.subject)
        if handler is not None:
            handler(msg)


class Listening:
    """One inbox's place in :class:`Inboxes`; unsubscribed as a subscription is."""

    __slots__ = ("_handlers", "inbox")

    def __init__(self, handlers: dict[str, Handler], inbox: str) -> None:
        self._handlers = handlers
        self.inbox = inbox

    async def unsubscribe(self) -> None:
        self._handlers.pop(self.inbox, None)
