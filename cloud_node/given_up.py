"""Requests JetStream gave up on, read from a stream: none goes unheard.

JetStream says once, in an advisory (core NATS), that a queued request's deliveries ran out
(``max_deliver``: each of its workers died with it). Whichever worker of the pool listened
ended it (:meth:`cloud_node.outcomes.Outcomes.end_given_up`); when none did (the pool's last
worker killed on the last delivery, a pool restarting, a worker stopping as it came), nothing
ever did: its message stayed queued, and a request that could wait kept no outcome, its site's
client told "ask again" for ever (review S20b).

The hub's stream ``MESH_GIVEN_UP`` keeps the queue's advisories
(:func:`mesh.provision.given_up_config`), and each pool reads its own through a durable
consumer named as its queue consumer. A worker acks an advisory only once the request is ended,
and hands it back to try again later when it cannot be now (the hub refusing the keep): the next
worker of the pool, whenever it comes, ends what no worker heard. Reading takes no free slot, so
a pool at capacity still ends its given-up requests at once, ``ack_wait`` after the last
delivery's worker died, as before. A worker whose credentials predate the stream listens to the
advisory itself (:class:`cloud_node.worker.Worker`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.pull import Pull, PullLost
from mesh.tasks import cancel_and_wait, raise_if_cancelled
from protocol.subjects import GIVEN_UP_STREAM, given_up_subject

log = get_logger(__name__)

FETCH_S = 2.0
"""How long one pull request waits for an advisory (a long poll: one request each 2 s idle)."""
HANDED_BACK_S = FETCH_S + 0.5
"""When an advisory a stopping worker was ending goes to another: once this worker's open
pull request expired at the server (sooner, it would be delivered into it again, and wait out
the stream's ack wait, 30 s)."""
BATCH = 16
AT_ONCE = 64
"""Advisories one worker ends at once, at most."""
HEARTBEAT_S = 1.0
"""JetStream's idle heartbeat on the open pull: two missed, and the pull is asked again."""
AGAIN_FIRST_S = 1.0
AGAIN_MAX_S = 30.0
"""When an advisory handed back is read again: 1 s after its first try, doubling up to 30 s."""
LOST_PAUSE_S = 0.5
LOST_PAUSE_MAX_S = 5.0


class GivenUp:
    """The pool's given-up requests (``consumer`` of the queue ``stream``), each ended with
    ``end`` (True: ended, or nothing left to end; False: try again later): read from the
    stream, or heard in the advisory (``hear``) where the stream cannot be had. ``lost``: told
    when the pool's consumer there is gone (the worker puts it back: its deletion's advisory
    is watched too)."""

    def __init__(
        self,
        conn: Connection,
        stream: str,
        consumer: str,
        end: Callable[[Msg], Awaitable[bool]],
        hear: Callable[[Msg], Awaitable[None]],
        *,
        lost: Callable[[str], None] = lambda _why: None,
    ) -> None:
        self.conn = conn
        self.stream = stream
        self.consumer = consumer
        self.end = end
        self.hear = hear
        self.lost = lost
        self.readable = True
        """Whether the hub's stream could be had (the worker's provisioning says)."""
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self._group = ""

    async def start(self, *, group: str) -> None:
        """Read the stream (:attr:`readable`), or listen to the advisory in queue group
        ``group``."""
        self._group = group
        await self.use(read=self.readable)

    async def use(self, *, read: bool) -> None:
        """Read the stream from now on (once it can be had: a worker whose provisioning of it
        failed once listened to the advisory for its whole life), or listen."""
        if read and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="given-up")
            if self._sub is not None:
                sub, self._sub = self._sub, None
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        elif not read and self._task is None and self._sub is None:
            subject = given_up_subject(self.stream, self.consumer)
            self._sub = await self.conn.nc.subscribe(subject, queue=self._group, cb=self.hear)

    async def stop(self) -> None:
        """Stop reading (an advisory being ended is read again by another worker) or
        listening."""
        if self._task is not None:
            await cancel_and_wait([self._task])
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()

    async def run(self) -> None:
        """Until cancelled; a pull lost (a reconnect, the stream deleted and put back) is asked
        again after a pause."""
        pull = Pull(
            self.conn,
            GIVEN_UP_STREAM,
            self.consumer,
            prefix=self.conn.api_prefix,
            heartbeat=HEARTBEAT_S,
        )
        pause = LOST_PAUSE_S
        while True:  # a connection closed as the worker starts: until it is open
            try:
                await pull.start()
                break
            except nats.errors.Error as exc:
                log.info("given-up requests not read yet", why=repr(exc), pause=pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, LOST_PAUSE_MAX_S)
        busy: set[asyncio.Task[None]] = set()  # each advisory on its own: a keep that waits
        try:  # holds up no other (one at a time, the next waited out the first's refusals)
            while True:
                raise_if_cancelled()  # one a wait_for swallowed (Python 3.11)
                if len(busy) >= AT_ONCE:
                    await asyncio.wait(busy, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    msgs = await pull.fetch(min(BATCH, AT_ONCE - len(busy)), FETCH_S)
                except (PullLost, nats.errors.Error) as exc:
                    log.info("given-up requests not read now", why=repr(exc), pause=pause)
                    if isinstance(exc, PullLost):
                        self.lost(f"{GIVEN_UP_STREAM}'s consumer: {exc}")
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, LOST_PAUSE_MAX_S)
                    continue
                pause = LOST_PAUSE_S
                for msg in msgs:
                    task = asyncio.get_running_loop().create_task(self._one(msg))
                    busy.add(task)
                    task.add_done_callback(busy.discard)
        finally:
            await cancel_and_wait(list(busy))  # not acked: read again by another worker
            await pull.stop()

    async def _one(self, msg: Msg) -> None:
        try:
            ended = await self.end(msg)
        except asyncio.CancelledError:  # stopping: to the next worker soon, not after ack wait
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=HANDED_BACK_S)
            raise
        except Exception:  # a fault: the advisory stays, and is read again
            log.exception("a given-up request not ended; reading it again later")
            ended = False
        with contextlib.suppress(nats.errors.Error):
            if ended:
                await msg.ack()
            else:
                tries = msg.metadata.num_delivered
                await msg.nak(delay=min(AGAIN_FIRST_S * 2 ** (tries - 1), AGAIN_MAX_S))
