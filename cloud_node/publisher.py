"""Publishing one attempt's events on the request's token subject, so that none is lost.

Events go out with a plain publish, through the connection's write batch
(:mod:`mesh.write_batch`): the answer store (stream ``MESH_TOK``) captures them as they pass, and
the hot path waits for nothing. The end (or final error) goes through JetStream, after the write
batch is flushed, and waits for its ack: once it returns, the store holds the outcome, and only
then does the worker ack the request. If the connection dropped while the answer streamed,
events written to the old socket may never have reached the server (likewise when the write
batch dropped a burst); the publisher then reads what the store kept and publishes again
whatever of its own events is missing. Readers drop the duplicates.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError

from mesh.answer_store import AnswerStore
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.tasks import TaskSet
from mesh.write_batch import CONTENT_TYPE_BLOCKS
from protocol.codec import CONTENT_TYPE, WireFormat, dump_event
from protocol.errors import MeshError
from protocol.messages import EndEvent, ErrorEvent, StartEvent, TokenEvent, WireEvent
from protocol.subjects import token_subject

log = get_logger(__name__)
CATCH_UP_RETRY_S = 0.25
"""Seconds before the end's second check of the answer store, when the first finds it short;
past that the worker settles the answer in the background (:meth:`AnswerPublisher.settle`),
so that a store that is away does not hold the request's slot."""
MAX_SETTLING = 256
"""Answers whose store copy is made whole in the background at once, at most."""
RESEND_GAP_S = 0.25
"""An answer is published again at most this often, whoever asks: each reader's "are you
there?" word may ask, and 500 words from one edge made a worker publish the answer 500 times
over, queueing other edges' words behind it (review S20a). What is asked within the gap is
published once at its end, for every reader that asked (:meth:`AnswerPublisher.resend`)."""
CATCH_UPS_AT_ONCE = 8
"""Of those, how many read the store and publish again at one time: a store that comes back
under many answers settling is not read by all of them in one burst, which would hold up the
answers streaming meanwhile."""


class AnswerPublisher:
    def __init__(
        self,
        conn: Connection,
        store: AnswerStore,
        scope: str,
        request_id: str,
        fmt: WireFormat,
        *,
        timeout: float,
    ) -> None:
        self.conn = conn
        self.store = store
        self.request_id = request_id
        self.subject = token_subject(scope, request_id)
        self.fmt = fmt
        self.timeout = timeout
        self._headers = {CONTENT_TYPE: fmt.content_type}
        self._sent: list[tuple[WireEvent, bytes]] = []
        self._resent_at = -RESEND_GAP_S
        self._asked: tuple[int, int, int | None] | None = None
        """What readers asked for within RESEND_GAP_S of the last resend, all of it in one ask
        (the oldest attempt, the lowest position, the widest hold), published at the gap's end."""
        self._asked_timer: asyncio.TimerHandle | None = None
        self._later = TaskSet("resend")
        self._reconnects = conn.reconnects
        self._failures = conn.write_batch.failures
        self._losses = store.losses
        self._missed_at: int | None = None
        """The store's generation when :meth:`finish` found it missing (None: it did not)."""
        self._lock = asyncio.Lock()
        self.republished = 0
        self.last_token: float | None = None
        """When this attempt last published a token (``time.monotonic()``); None before its
        first: what tells an engine that stands still mid-answer (see ``Handler.stalled``)."""

    def sent(self) -> list[WireEvent]:
        """This attempt's events, in the order they were published."""
        return [event for event, _data in self._sent]

    @property
    def finished(self) -> bool:
        """Whether this attempt's outcome (end or error) went out: its engine is done with it."""
        return bool(self._sent) and isinstance(self._sent[-1][0], (EndEvent, ErrorEvent))

    async def resend(self, attempt: int, seq: int, upto: int | None = None) -> int:
        """Publish again, on the token subject, what a reader lacks of this attempt: it has
        ``seq`` positions of attempt ``attempt`` and, when ``upto`` is given, holds this
        attempt's events from position ``upto`` on. Nothing for a reader on a newer attempt.
        The number of events published.

        For a reader whose gap the answer store cannot fill: an event published as the store's
        leader died reached neither the store nor a reader whose server died with it, and this
        worker, whose own connection never dropped, has no reason to publish it again until its
        end goes unconfirmed (seconds, a whole election, later). Readers drop duplicates."""
        if not self._sent or not isinstance(self._sent[0][0], StartEvent):
            return 0
        own = self._sent[0][0].attempt
        if attempt > own:
            return 0
        if attempt < own:  # it lacks this attempt's start: all of it
            wanted = [data for _event, data in self._sent]
        else:
            wanted = [data for event, data in self._sent if _lacks(event, seq, upto)]
        if not wanted:
            return 0
        now = time.monotonic()
        wait = self._resent_at + RESEND_GAP_S - now
        if wait > 0:  # a reader whose ask fell within the gap still gets what it lacks
            self._ask_later(attempt, seq, upto, wait)
            return 0
        self._resent_at = now
        log.info("publishing again what a reader lacks", count=len(wanted), seq=seq, upto=upto)
        try:
            for data in wanted:
                await self.conn.nc.publish(self.subject, data, headers=self._headers)
        except nats.errors.Error as exc:
            log.warning("resend failed", error=repr(exc))
            return 0
        return len(wanted)

    def _ask_later(self, attempt: int, seq: int, upto: int | None, wait: float) -> None:
        """Keep an ask that came within the gap, with any kept before it, for its end: a
        reader told nothing waited for its next failed store read (0.2 s or more) to ask
        again, and that ask could fall within the gap too."""
        if self._asked is not None:
            before, low, held = self._asked
            attempt, seq = min(before, attempt), min(low, seq)
            upto = None if upto is None or held is None else max(held, upto)
        self._asked = (attempt, seq, upto)
        if self._asked_timer is None:
            self._asked_timer = asyncio.get_running_loop().call_later(wait, self._resend_asked)

    def _resend_asked(self) -> None:
        self._asked_timer = None
        asked, self._asked = self._asked, None
        if asked is not None and not self.conn.closed:
            self._later.spawn(self.resend(*asked), name="resend")

    def forget(self) -> None:
        """Drop an ask kept for the gap's end: the worker no longer holds this answer (handed
        back, lost, superseded, settled or stopped), and a resend then could carry a reader of
        the next attempt past where that attempt resumes (review S26a)."""
        if self._asked_timer is not None:
            self._asked_timer.cancel()
            self._asked_timer = None
        self._asked = None

    async def send(self, event: WireEvent) -> None:
        self.send_now(event)

    def send_now(self, event: WireEvent) -> None:
        """:meth:`send`, which never waits: what :func:`mesh.generate.generate_into` calls for
        each token (no coroutine per token)."""
        data = dump_event(event, self.fmt)
        self._sent.append((event, data))
        # Through the write batch, written together with other answers' events (the start and the
        # first token never wait for its gap). Raises MeshError once the connection is closed.
        # Tokens go without headers: their first byte tells msgpack from JSON, and a header
        # costs both ends a parse per message (relay without coalescing: the client's CPU per
        # 10k tokens 111 -> 90-99 ms, the worker's 94 -> 80-87 ms).
        headers = None
        if isinstance(event, TokenEvent):
            self.last_token = time.monotonic()
        else:
            headers = CONTENT_TYPE_BLOCKS[self.fmt]
        self.conn.write_batch.put(self.subject, data, headers, now=len(self._sent) <= 2)

    async def finish(self, event: EndEvent | ErrorEvent) -> bool:
        """Publish the outcome and make sure the store holds the whole attempt; False when that
        could not be confirmed (the outcome still went out as a plain publish)."""
        data = dump_event(event, self.fmt)
        self._sent.append((event, data))
        # The events before it go first, in the same write as it (nats-py writes both).
        self.conn.write_batch.hand_over()
        stored = await self._publish_stored(data)
        unbroken = (  # no burst of events dropped, no store lost meanwhile
            self.conn.write_batch.failures == self._failures and self.store.losses == self._losses
        )
        if stored and unbroken and self.conn.reconnects == self._reconnects:
            return True
        if self.store.missing:  # the settler makes it whole once the store is back
            self._missed_at = self.store.losses
            return False
        if await self.catch_up():
            return True
        await asyncio.sleep(CATCH_UP_RETRY_S)  # a store that just came back may refuse a read
        return await self.catch_up()

    async def settle(self, within: float, gate: asyncio.Semaphore | None = None) -> bool:
        """After :meth:`finish` could not confirm the store: keep trying, with backoff, to make
        it whole, each try within a place in ``gate`` had in time. A reader waiting on a gap
        reads the store again now and then, so what is published here still reaches it. True
        once the store holds every event; False after ``within`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        # A store found missing at the end and back since (in the loop turns before this began)
        # is not waited for: its return has been and gone.
        back = not self.store.missing and self._missed_at not in (None, self.store.losses)
        pauses = _pauses(back)
        while (left := deadline - loop.time()) > 0:
            pause = next(pauses)
            # Its return: the one to wait for. Back now, it is tried at once, then soon again.
            if pause and await self.store.came_back(min(pause, left)):
                pauses = _pauses(True)
                next(pauses)
            if await self._gated_catch_up(gate, deadline):
                return True
        return False

    async def _gated_catch_up(self, gate: asyncio.Semaphore | None, deadline: float) -> bool:
        if gate is None:
            return await self.catch_up()
        acquiring = asyncio.ensure_future(gate.acquire())
        try:
            timeout = max(deadline - asyncio.get_running_loop().time(), 0)
            await asyncio.wait({acquiring}, timeout=timeout)
        except asyncio.CancelledError:  # a place it gets all the same is given back
            acquiring.cancel()
            acquiring.add_done_callback(functools.partial(_give_back, gate))
            raise
        if not acquiring.done():  # none in time
            acquiring.cancel()
            await asyncio.wait({acquiring})
        if acquiring.cancelled():
            return False
        try:
            return await self.catch_up()
        finally:
            gate.release()

    async def catch_up(self) -> bool:
        """Publish again what the store lacks of this attempt's events (after a reconnect, so
        that readers' gaps close at once, and before the outcome is trusted)."""
        async with self._lock:
            return await self._catch_up()

    async def _catch_up(self) -> bool:
        # The counters move on only once the store is known to hold everything: a catch-up
        # that failed leaves them behind, so that finish() checks again.
        reconnects, losses = self.conn.reconnects, self.store.losses
        await self.conn.write_batch.flush()  # what is still queued is not missing
        failures = self.conn.write_batch.failures
        try:
            kept = await self.store.replay(self.subject, timeout=self.timeout)
        except (MeshError, nats.errors.Error) as err:
            log.warning("cannot check the answer store", error=getattr(err, "message", repr(err)))
            return False
        have = {_key(e) for e in kept}
        missing = [data for event, data in self._sent if _key(event) not in have]
        if not missing:
            self._reconnects, self._failures, self._losses = reconnects, failures, losses
            return True
        log.info("publishing lost events again", count=len(missing), of=len(self._sent))
        try:
            for data in missing[:-1]:
                await self.conn.nc.publish(self.subject, data, headers=self._headers)
        except nats.errors.Error as exc:
            log.warning("republish failed", error=repr(exc))
            return False
        if not await self._publish_stored(missing[-1]):
            return False
        self.republished += len(missing)
        self._reconnects, self._failures, self._losses = reconnects, failures, losses
        return True

    def take_republished(self) -> int:
        """Events published again since the last call (each counted once, wherever counted)."""
        count, self.republished = self.republished, 0
        return count

    async def _publish_stored(self, data: bytes) -> bool:
        """Publish through JetStream (waits for the store's ack), or plainly when the store is
        off, known gone, or does not answer."""
        if self.store.enabled and not self.store.missing:
            try:
                await self.conn.publish_acked(
                    self.subject,
                    data,
                    timeout=self.timeout,
                    headers=dict(self._headers),
                    gone=self.store.gone,  # a deleted store: told in a second, not at timeout
                )
                return True
            except (
                asyncio.TimeoutError,
                nats.errors.Error,
                APIError,
                NoStreamResponseError,
            ) as exc:
                log.warning("answer store did not confirm the end", error=repr(exc))
        try:
            await self.conn.nc.publish(self.subject, data, headers=self._headers)
            await self.conn.nc.flush(timeout=max(1, round(self.timeout)))
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("cannot publish the end", error=repr(exc))
        return not self.store.enabled


def _give_back(gate: asyncio.Semaphore, acquiring: asyncio.Future[bool]) -> None:
    if not acquiring.cancelled():
        gate.release()


def _pauses(back: bool) -> Iterator[float]:
    """The pauses before each try to settle: 1 s, doubling to 10 s. For a store back already,
    a try at once, then one after :data:`CATCH_UP_RETRY_S` (a store just back may refuse a
    read), then the same."""
    if back:
        yield from (0.0, CATCH_UP_RETRY_S)
    pause = 1.0
    while True:
        yield pause
        pause = min(pause * 2, 10.0)


def _key(event: WireEvent) -> tuple[str, int | None, int]:
    return (event.t, event.attempt, getattr(event, "seq", 0))


def _lacks(event: WireEvent, seq: int, upto: int | None) -> bool:
    """Whether a reader with ``seq`` positions of this attempt, holding its events from
    ``upto`` on (None: none held), lacks ``event`` of the same attempt."""
    if isinstance(event, StartEvent):
        return False
    if isinstance(event, ErrorEvent):
        return upto is None
    position = getattr(event, "seq", 0)
    return position >= seq and (upto is None or position < upto)


class Settler:
    """Answers acked while their store copy could not be confirmed (:meth:`AnswerPublisher.finish`
    returned False), made whole in the background, for ``within`` seconds each and at most
    MAX_SETTLING at once: past that, readers with a gap have their own timeouts. ``counted`` is
    called with each publisher once it is done (to count what it published again)."""

    def __init__(self, within: float, counted: Callable[[AnswerPublisher], None]) -> None:
        self.within = within
        self._counted = counted
        self._tasks = TaskSet("settle")
        self._gate = asyncio.Semaphore(CATCH_UPS_AT_ONCE)
        self.publishers: dict[str, AnswerPublisher] = {}
        """The publishers settling, by token subject (a reader's resend finds them here)."""

    def __len__(self) -> int:
        return len(self._tasks)

    def later(self, publisher: AnswerPublisher) -> None:
        if len(self._tasks) >= MAX_SETTLING:
            log.warning("answer store incomplete; too many answers settling already")
            return
        self.publishers[publisher.subject] = publisher  # found by a reader's ask from now on
        self._tasks.spawn(self._settle(publisher), name="settle")

    async def _settle(self, publisher: AnswerPublisher) -> None:
        try:
            whole = await publisher.settle(self.within, self._gate)
        finally:
            publisher.forget()
            if self.publishers.get(publisher.subject) is publisher:
                del self.publishers[publisher.subject]
            self._counted(publisher)
        if whole:
            log.info("answer store whole again", request_id=publisher.request_id)
        else:
            log.warning("answer store still incomplete", request_id=publisher.request_id)

    async def close(self) -> None:
        """Stop at once: a worker that stops leaves what is still missing to the readers."""
        if len(self._tasks):
            log.warning("stopping with answers still settling", count=len(self._tasks))
        await self._tasks.close(grace=0)
