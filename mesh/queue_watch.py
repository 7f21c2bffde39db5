"""Requests queued and not started yet, watched for the loss of their queue.

A request waits in its pool's work queue until a worker starts it. When the queue is lost under
it, nothing tells its sender: the stream deleted with the links up (``nats stream rm``), the
hub restarted on an empty store. A sender connected to the hub sees the restart as a reconnect;
an edge on a site's leaf node does not (its link to the leaf stays up), nor does anyone when
the stream is deleted. Before, an edge waited out its ``cloud_start_timeout`` (10 s) and
answered locally, and the SDK waited for its ``first_event_timeout``.

One :class:`QueueWatch` per connection looks at the pool's consumer (``CONSUMER.INFO``, which
an edge may call under its least privileges): once at the first request for a pool, then once
a second while some request has waited a second or more unstarted, and at once after a
reconnect. The consumer gone, or made again since the last look (its ``created`` time moved:
whoever put the queue back made it anew), means the queue may have lost what it held:

- gone: every waiting request is marked lost, and the consumer is looked for again (0.1 s,
  doubling to 1 s) until a worker has put the queue back;
- back, or made again: every waiting request is queued again once, under its message id
  (:meth:`mesh.queue.CloudCall.requeue`). A queue that still holds it drops the copy as a
  duplicate; one made anew takes it.

The look comes at once when JetStream says a consumer of the queue was made
(``$JS.EVENT.ADVISORY.CONSUMER.CREATED.<stream>.*``, heard from the first request on): the
worker that put a lost queue back made its consumer anew, so the waiting requests go again
within a round trip of it rather than at the next look (1.1 s after a deletion, before). The
looks stay for what the word does not reach: a sender whose credentials may not hear it, a
word lost with a link.

One look serves every request of the pool on the connection, so a reconnect costs one API call
per pool, not one publish per waiting request (before, every request not started was queued
again after every reconnect, each with its own retries on the same schedule).
A look that gets no answer (the link is down, the hub elects a leader, the caller may not ask)
proves nothing; looks slow down to one in :data:`MAX_PAUSE_S` while they keep failing, or while a
backlog waits in a queue that stays the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import datetime
from typing import Protocol, cast

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.stream_deleted import consumer_created, listen, models_named, unlisten
from protocol.subjects import consumer_name

log = get_logger(__name__)
LOOK_S = 1.0
"""How long a request waits unstarted before its pool's consumer is looked at, and the pause
between two looks while requests wait."""
REGONE_FIRST_S, REGONE_MAX_S = 0.1, 1.0
"""While the consumer is gone: the first pause before the next look, and the longest."""
MAX_PAUSE_S = 4.0
"""While its requests keep waiting, the pause between looks doubles from :data:`LOOK_S` up to
this as long as the consumer stays the same (a backlog of seconds is no loss: a thousand edges
looking once a second would add a thousand API calls a second to a hub saturated already) or
looks get no answer; a change, a reconnect or a leaf's "no responders" sets it back."""
LOOK_TIMEOUT_S = 1.0
_UNKNOWN = object()
"""A pool whose first look got no answer: the next look that does counts as a change."""


class Waiting(Protocol):
    """A queued request as the watch sees it (:class:`mesh.queue.CloudCall`)."""

    @property
    def model(self) -> str: ...

    @property
    def queued_at(self) -> float:
        """When it was queued (``time.monotonic()``)."""
        ...

    @property
    def started(self) -> bool: ...

    def requeue(self) -> None:
        """Queue it again, under its message id (at most one try in flight)."""
        ...


class QueueWatch:
    """The waiting requests of one connection (see the module's docstring)."""

    def __init__(self, conn: Connection, stream: StreamSettings) -> None:
        self._conn = conn
        self._stream = stream
        self._calls: dict[str, set[Waiting]] = {}
        self._created: dict[str, datetime | object | None] = {}
        """Each pool's consumer at the last look that got an answer (None: it was gone)."""
        self._lost: dict[str, set[Waiting]] = {}
        """Requests whose queue was gone at a look: queued again once it is back."""
        self._regone = REGONE_FIRST_S
        self._pause = LOOK_S
        self._every = False
        """The next look is at every pool, however long its requests waited (a reconnect)."""
        self._timer: asyncio.TimerHandle | None = None
        self._looking: asyncio.Task[None] | None = None
        self._reconnects = conn.reconnects
        self._undo_loss: Callable[[], None] | None = None
        self._hearing: asyncio.Task[None] | None = None
        """Subscribing to the queue's "consumer created" word, from the first request on (None
        again after a try that got no answer: the next look tries again)."""
        self._heard: Subscription | None = None
        self._due: set[str] = set()
        """Pools whose consumer was made since the last look: looked at, at once."""
        self._closed = False

    def add(self, call: Waiting) -> None:
        """Watch ``call``, queued just now, until :meth:`discard`."""
        self._calls.setdefault(call.model, set()).add(call)
        self._listen()
        if self._undo_loss is None:
            self._reconnects = self._conn.reconnects
            self._undo_loss = self._conn.on_loss(self._after_loss)
        if call.model not in self._created:  # set by the first look, answered or not
            self._look_now()  # what the consumer is now: later looks compare with it
        elif self._timer is None and self._looking is None:
            self._arm(LOOK_S)

    def discard(self, call: Waiting) -> None:
        calls = self._calls.get(call.model)
        if calls is None or call not in calls:
            return
        calls.discard(call)
        lost = self._lost.get(call.model)
        if lost is not None:
            lost.discard(call)
        if not calls:
            del self._calls[call.model]
            self._lost.pop(call.model, None)
        if not self._calls:  # nothing to watch: no timer, no listener
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._undo_loss is not None:
                self._undo_loss()
                self._undo_loss = None

    def _after_loss(self) -> None:
        if self._conn.reconnects == self._reconnects:
            return  # messages dropped (a slow consumer), not a link that came back
        self._reconnects = self._conn.reconnects
        if self._heard is None and self._hearing is not None and self._hearing.done():
            self._hearing = None  # refused before: tried again now (new rights)
        self._listen()
        self._every, self._pause = True, LOOK_S
        self._look_now()

    def _listen(self) -> None:
        """Subscribe to the word that the queue was put back, unless that is done or under
        way. Tried again at each look while requests wait (and after a reconnect): a try that
        got no answer in time was tried again only by the next request queued, and requests
        that kept waiting had the looks alone, up to 4 s apart (review S27a)."""
        if self._hearing is None and self._calls and not self._closed:
            self._hearing = asyncio.get_running_loop().create_task(
                self._hear(), name="queue-watch-hear"
            )

    async def _hear(self) -> None:
        """Subscribe to the word that a consumer of the queue was made (a plain subscription:
        nats-py makes it again after a reconnect). Refused (credentials minted before senders
        heard it), the looks alone go on."""
        subject = consumer_created(self._stream.name, "*")
        self._heard, again = await listen(self._conn, subject, self._made, "the queue put back")
        if again:
            self._hearing = None  # the next look tries again

    async def _made(self, msg: Msg) -> None:
        """A consumer of the queue was made: look at once at its pool, if requests wait for it."""
        due = set(models_named(msg, self._calls))
        if due:
            self._due |= due
            self._look_now()

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if not self._closed:
            self._timer = asyncio.get_running_loop().call_later(delay, self._look_now)

    def _look_now(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closed or self._looking is not None or not self._calls:
            return  # a look under way looks again when it ends, if asked to (_every)
        self._looking = asyncio.get_running_loop().create_task(self._look(), name="queue-watch")

    async def _look(self) -> None:
        self._listen()
        try:
            every, self._every = self._every, False
            made, self._due = self._due, set()
            now = time.monotonic()
            soon = every
            for model, calls in list(self._calls.items()):
                due = (
                    every
                    or model in made
                    or model not in self._created
                    or model in self._lost
                    or any(not c.started and now - c.queued_at >= LOOK_S for c in calls)
                )
                if due:
                    soon = await self._look_at(model) or soon
            self._pause = LOOK_S if soon else min(self._pause * 2, MAX_PAUSE_S)
        except Exception:  # a fault here must not stop the watch
            log.exception("queue watch failed")
        finally:
            self._looking = None
        if self._closed:
            return  # its requests end with its connection
        if self._every or self._due:
            self._look_now()
        elif self._timer is None:
            delay = self._next_due()
            if delay is not None:
                self._arm(delay)

    def _next_due(self) -> float | None:
        """Seconds to the next look: when the request waiting longest unstarted will have
        waited :data:`LOOK_S` (one that waited that long already: after the pause); None when
        every request is started (the next one queued sets the timer again)."""
        if self._lost:
            return min(self._regone, self._pause)
        now = time.monotonic()
        waited = max(
            (now - c.queued_at for calls in self._calls.values() for c in calls if not c.started),
            default=None,
        )
        if waited is None:
            return None
        return self._pause if waited >= LOOK_S else max(LOOK_S - waited, 0.05)

    async def _look_at(self, model: str) -> bool:
        """Look at ``model``'s consumer and act on what changed; True when the next look should
        come soon: something changed, or a leaf said "no responders" (its uplink is down: the
        hub may come back with its queue lost, and asking the leaf costs nothing)."""
        try:
            info = await self._conn.jsm().consumer_info(
                self._stream.name, consumer_name(model), timeout=LOOK_TIMEOUT_S
            )
            created: datetime | None = info.created
        except NotFoundError:
            created = None
        except (APIError, nats.errors.Error, asyncio.TimeoutError, RuntimeError) as exc:
            # No answer (the link is down, an election, the caller may not ask): nothing proven.
            self._created.setdefault(model, _UNKNOWN)
            # nats-py's word for "no responders" is a ServiceUnavailableError with no code
            return isinstance(exc, ServiceUnavailableError) and exc.err_code is None
        known, before = model in self._created, self._created.get(model)
        self._created[model] = created
        calls = self._calls.get(model, set())
        waiting = {c for c in calls if not c.started}
        if created is None:
            if waiting:
                first = model not in self._lost
                self._lost.setdefault(model, set()).update(waiting)
                self._regone = REGONE_FIRST_S if first else min(self._regone * 2, REGONE_MAX_S)
                if first:
                    log.warning(
                        "the work queue is gone: its waiting requests go again once it is back",
                        model=model,
                        waiting=len(waiting),
                    )
            return True
        lost = self._lost.pop(model, set())
        if not self._lost:
            self._regone = REGONE_FIRST_S
        if known and before != created:
            lost |= waiting  # made again (or first seen after a look that failed): may be gone
        for call in lost:
            if not call.started:
                call.requeue()
        return bool(lost)

    async def close(self) -> None:
        """Stop looking (its connection closes: its requests end with it)."""
        self._closed = True
        hearing, self._hearing = self._hearing, None
        heard, self._heard = self._heard, None
        await unlisten(hearing, heard)
        if self._undo_loss is not None:
            self._undo_loss()
            self._undo_loss = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        looking, self._looking = self._looking, None
        if looking is not None:
            looking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await looking


def queue_watch(conn: Connection, stream: StreamSettings) -> QueueWatch:
    """The watch of ``conn``'s requests queued on ``stream`` (one per connection and stream)."""
    watch = conn.queue_watches.get(stream.name)
    if watch is None:
        watch = conn.queue_watches[stream.name] = QueueWatch(conn, stream)
    return cast(QueueWatch, watch)
