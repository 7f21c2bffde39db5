"""Whether a delivery may be of a request another worker holds already: the message is older
than the consumer that delivered it.

A pool's consumer deleted and made again (``nats consumer rm``, a worker's restore after
"Consumer Deleted") over a stream that kept its messages delivers each of them again as a first
delivery. A worker may still hold one of them from the consumer that was lost, generating it as
attempt 1: a second worker taking it as attempt 1 too would have readers mix the two (they tell
attempts apart, not nodes). Such a delivery is numbered as a copy queued again by its sender is
(:data:`mesh.queue.COPY_HEADER`, :func:`cloud_node.takeover.unseen_attempt`).

The consumer's creation time is looked up (one look at a time per consumer, each a
``CONSUMER.INFO``), and a delivery waits for it: at a worker's first delivery from the consumer
(unless :meth:`QueueEpoch.look` ran ahead, as the worker's start and restore do), when its
deliveries count from lower than before (a consumer made anew counts from 1), after the worker
heard its consumer was lost (:meth:`QueueEpoch.forget`: JetStream's advisory that the consumer
or its stream was deleted, a pull ended "Consumer Deleted", a reconnect), and once the last
look is :data:`LOOK_AGAIN_S` old (word of a deletion that never came: an advisory dropped on a
live link). A look that fails counts every delivery as maybe held for :data:`FAILED_LOOK_S`:
the safe side (the store read first, the attempt numbered high).

A look that finds a consumer made after the one looked at before tells
:attr:`QueueEpoch.on_made_anew`, with when the look began: the worker's pull requests asked
before then may have been asked of the one before, and went with it (JetStream ends them with a
409 only when it still can).

Each look has the next made :data:`LOOK_AHEAD_S` later, in the background, so that a
delivery finds a look younger than :data:`LOOK_AGAIN_S` and waits for none (a look ahead that
fails leaves a good one in place: it counts only once that is old). Before, the
first delivery after 5 s quiet waited for a round trip to the hub (0.63 ms p50 here, on
loopback) before its engine was asked: every request did, when requests came further apart
than that. The cost: one ``CONSUMER.INFO`` per :data:`LOOK_AHEAD_S` per worker and model.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import current_task
from collections.abc import Callable
from datetime import datetime, timezone

from nats.aio.msg import Msg

from mesh.connection import Connection
from mesh.logs import get_logger

log = get_logger(__name__)
LOOK_AGAIN_S = 5.0
"""How old a look may be before a delivery looks again (and waits for it)."""
LOOK_AHEAD_S = 4.0
"""How long after a look the next is made, ahead of deliveries."""
FAILED_LOOK_S = 1.0
"""How long a failed look stands (every delivery meanwhile counted as maybe held)."""
NEVER = datetime.min.replace(tzinfo=timezone.utc)


class QueueEpoch:
    """The creation time of each consumer this worker's deliveries come from."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout
        self._created: dict[str, tuple[datetime | None, float]] = {}
        """By consumer: its creation time (None: the look failed), and when it was looked up."""
        self._last: dict[str, int] = {}
        """The highest consumer sequence seen from each consumer."""
        self._looking: dict[str, asyncio.Future[None]] = {}
        self._forgotten = 0
        """How many times :meth:`forget` was called: a look begun before counts for nothing."""
        self._timers: dict[str, asyncio.TimerHandle] = {}
        """By consumer: the next look, made ahead of deliveries."""
        self._closed = False
        self._made: dict[str, datetime] = {}
        """By consumer: the creation time last seen (kept over :meth:`forget`)."""
        self.on_made_anew: Callable[[str, float], None] = lambda _consumer, _began: None
        """Told a consumer's name and when the look that found it made anew began (loop time)."""

    def forget(self) -> None:
        """The worker heard its consumer was lost: look again at the next delivery (a look
        under way may have seen the consumer before it was made anew)."""
        self._created.clear()
        self._last.clear()
        self._looking.clear()
        self._forgotten += 1

    async def look(self, stream: str, consumer: str) -> None:
        """Look ``consumer`` up now, and from then on ahead of its deliveries, which then need
        not wait (until :meth:`close`)."""
        await self._look(stream, consumer)

    def close(self) -> None:
        """No more looks ahead (the worker stops)."""
        self._closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    async def predates(self, msg: Msg) -> bool:
        """Whether ``msg`` was stored before the consumer that delivered it was made (each of
        its deliveries then is: a redelivery must number above the first, too)."""
        meta = msg.metadata
        consumer, seq = meta.consumer, meta.sequence.consumer
        if consumer is None:
            return False
        known = self._created.get(consumer)
        now = time.monotonic()
        stale = known is None or now - known[1] > (LOOK_AGAIN_S if known[0] else FAILED_LOOK_S)
        if stale or seq <= self._last.get(consumer, 0):
            # Counting from lower: a look under way may predate the consumer made anew.
            await self._look(meta.stream, consumer, fresh=not stale)
            self._last[consumer] = seq
        else:
            self._last[consumer] = max(seq, self._last.get(consumer, 0))
        known = self._created.get(consumer)  # forgotten meanwhile: the safe side
        created = known[0] if known is not None else None
        return created is None or meta.timestamp < created

    async def _look(self, stream: str, consumer: str, *, fresh: bool = False) -> None:
        await asyncio.shield(self._looking_for(stream, consumer, fresh=fresh))

    def _looking_for(
        self, stream: str, consumer: str, *, fresh: bool = False, ahead: bool = False
    ) -> asyncio.Future[None]:
        """The look at ``consumer`` under way, started when none is (or ``fresh``: anew)."""
        looking = self._looking.get(consumer)
        if fresh or looking is None or looking.done():
            looking = asyncio.ensure_future(self._lookup(stream, consumer, ahead))
            self._looking[consumer] = looking
        return looking

    def _ahead(self, stream: str, consumer: str) -> None:
        self._looking_for(stream, consumer, ahead=True)

    async def _lookup(self, stream: str, consumer: str, ahead: bool = False) -> None:
        forgotten, began = self._forgotten, asyncio.get_running_loop().time()
        try:
            info = await asyncio.wait_for(
                self.conn.jsm().consumer_info(stream, consumer), self.timeout
            )
            created = info.created or NEVER  # a server that does not say: none is held
        except Exception as exc:  # any failure says nothing: the safe side (and never a raise
            # out of a delivery's handler, before its request is even read)
            log.info("cannot tell when the queue's consumer was made", error=repr(exc))
            created = None
        if forgotten != self._forgotten or self._looking.get(consumer) is not current_task():
            return  # begun before a forget, or a fresher look was begun since
        known = self._created.get(consumer)
        if created is not None or not ahead or known is None or known[0] is None:
            self._created[consumer] = (created, time.monotonic())
        if created is not None and self._made.setdefault(consumer, created) != created:
            self._made[consumer] = created
            self.on_made_anew(consumer, began)
        if not self._closed:  # the next, ahead of deliveries
            if (timer := self._timers.get(consumer)) is not None:
                timer.cancel()
            self._timers[consumer] = asyncio.get_running_loop().call_later(
                LOOK_AHEAD_S, self._ahead, stream, consumer
            )
