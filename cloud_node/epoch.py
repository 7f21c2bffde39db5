"""Whether a first delivery may be one another worker holds already: the message is older than
the consumer that delivered it.

A pool's consumer deleted and made again (``nats consumer rm``, a worker's restore after
"Consumer Deleted") over a stream that kept its messages delivers each of them again as a first
delivery. A worker may still hold one of them from the consumer that was lost, generating it as
attempt 1: a second worker taking it as attempt 1 too would have readers mix the two (they tell
attempts apart, not nodes). Such a delivery is numbered as a copy queued again by its sender is
(:data:`mesh.queue.COPY_HEADER`, :func:`cloud_node.takeover.unseen_attempt`).

The consumer's creation time is looked up at a worker's first delivery from it, and again when
its deliveries count from lower than before (consumer sequences only grow: a lower one is a
consumer made anew). A look that fails says nothing (False): the delivery is numbered as ever.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError

from mesh.connection import Connection
from mesh.logs import get_logger

log = get_logger(__name__)


class QueueEpoch:
    """The creation time of each consumer this worker's deliveries come from."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout
        self._created: dict[str, datetime] = {}
        self._last: dict[str, int] = {}
        """The highest consumer sequence seen from each consumer."""

    async def predates(self, msg: Msg) -> bool:
        """Whether ``msg`` was stored before the consumer that delivered it was made (each of
        its deliveries then is: a redelivery must number above the first, too)."""
        meta = msg.metadata
        consumer, seq = meta.consumer, meta.sequence.consumer
        if consumer is None:
            return False
        if seq <= self._last.get(consumer, 0) or consumer not in self._created:
            await self._look(meta.stream, consumer)
        self._last[consumer] = seq
        created = self._created.get(consumer)
        return created is not None and meta.timestamp < created

    async def _look(self, stream: str, consumer: str) -> None:
        self._created.pop(consumer, None)
        try:
            info = await asyncio.wait_for(
                self.conn.jsm().consumer_info(stream, consumer), self.timeout
            )
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            log.info("cannot tell when the queue's consumer was made", error=repr(exc))
            return
        if info.created is not None:
            self._created[consumer] = info.created
