"""A reader whose answer-store read fails (a hub's store electing a leader) asks the worker for
what it lacks at once (``AnswerReader._repair_beside``, e052024), and no more often than the
store's own retries. Review S25a wrote these; the last three failed on e052024 (strict xfails
then): a resend for an answer already whole, a second gap waiting out the store's backoff
(1.50 s), and a gap held for a store read that hangs (1.02 s).

Real nats-server; the events are published on a plain connection as a worker publishes them, the
store and the worker's resend are stand-ins (as in ``tests/test_reader_checks.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
from nats.aio.client import Client

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.reader import AnswerReader
from mesh.repair import Repair, Watch
from protocol.codec import WireFormat, dump_event
from protocol.errors import UnavailableError
from protocol.messages import EndEvent, TokenEvent, Usage, WireEvent
from protocol.stream import AnswerState, AnswerWriter
from tests.helpers import eventually, holds

SUBJECT = "mesh.v1.tok.review.r1"


class _Worker:
    """A worker's side: publishes events (or loses them, as a dying server did) and publishes
    again what a reader lacks when asked (its tokens from the reader's positions on)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
        self.sent: list[WireEvent] = []
        self.asked: list[float] = []
        self.at_once = 0
        self.most_at_once = 0

    async def publish(self, event: WireEvent) -> None:
        await self.nc.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
        await self.nc.flush()

    async def emit(self, event: WireEvent, *, lost: bool = False) -> None:
        self.sent.append(event)
        if not lost:
            await self.publish(event)

    async def resend(self, state: AnswerState) -> None:
        self.asked.append(time.monotonic())
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        try:
            await asyncio.sleep(0.02)  # a round trip to the worker
            for event in self.sent:
                if isinstance(event, TokenEvent) and event.seq >= state.positions:
                    await self.publish(event)
        finally:
            self.at_once -= 1


class _Reading:
    """Reads a reader in a task of its own, noting when each token came out of next()."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reader = reader
        self.texts: list[str] = []
        self.at: dict[str, float] = {}
        self.ends = 0
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while not self.reader.state.done:
            for event in await self.reader.next(0.1):
                if isinstance(event, TokenEvent):
                    self.texts.append(event.text)
                    self.at.setdefault(event.text, time.monotonic())
                elif isinstance(event, EndEvent):
                    self.ends += 1

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def _down(_state: AnswerState) -> list[WireEvent]:
    raise UnavailableError("no responders: the answer store is not there")


def _failing_store() -> tuple[list[float], Repair]:
    """A store that cannot be read (no leader), and when it was asked."""
    reads: list[float] = []

    async def store(state: AnswerState) -> list[WireEvent]:
        reads.append(time.monotonic())
        return await _down(state)

    return reads, store


@dataclass
class _Setup:
    worker: _Worker
    reader: AnswerReader
    reading: _Reading | None = None

    def read(self) -> _Reading:
        self.reading = _Reading(self.reader)
        return self.reading

    async def gap(self) -> float:
        """Start, "a", "b" lost, "c": when the gap opened."""
        w = self.worker.writer
        for event in (w.start(), w.token("a")):
            await self.worker.emit(event)
        await self.worker.emit(w.token("b"), lost=True)
        opened = time.monotonic()
        await self.worker.emit(w.token("c"))
        return opened


@contextlib.asynccontextmanager
async def _setup(
    server: NatsServer, conn: Connection, store: Repair, resend: Watch | None = None
) -> AsyncIterator[_Setup]:
    """A worker's connection, and a reader of its subject with ``store`` (the worker's resend
    unless another is given), subscribed; all closed at the end."""
    nc = await nats.connect(server.url)
    worker = _Worker(nc)
    reader = AnswerReader(
        conn, AnswerState("r1"), store, what="the cloud", resend=resend or worker.resend
    )
    setup = _Setup(worker, reader)
    try:
        await reader.subscribe(SUBJECT)
        await conn.nc.flush()
        yield setup
    finally:
        if setup.reading is not None:
            await setup.reading.stop()
        await reader.close()
        await nc.close()


async def test_a_gap_the_store_cannot_be_read_for_is_asked_of_the_worker_at_once(
    nats_server: NatsServer, conn: Connection
) -> None:
    """A hub's stream leader killed: the answer store has no leader for the election (seconds),
    and a reader whose server died with it lost a token. Its store read fails ("no responders");
    the worker still has the token. The reader asks it now: it used to ask only once a store
    read succeeded, after retries 0.2 and 0.4 s apart (`mesh bench failover`: a leader kill
    left answers standing still 0.23 and 0.635 s, once in 6 and once in 7 runs)."""
    reads, store = _failing_store()
    async with _setup(nats_server, conn, store) as setup:
        reading = setup.read()
        await setup.gap()  # "b" went with the dead server
        await eventually(lambda: holds("c" in reading.at), 5, "the gap closed")
        assert reading.texts == ["a", "b", "c"]
        asked = setup.worker.asked
        assert asked and sum(r <= asked[0] for r in reads) == 1, "asked after one store read"
        assert len(reads) == 1, f"the store was read {len(reads)} times before the gap closed"


async def test_a_store_that_stays_down_asks_the_worker_once_per_store_retry_not_in_a_storm(
    nats_server: NatsServer, conn: Connection
) -> None:
    """A gap nobody fills, the store down throughout: the worker is asked at most once per
    failed store read (0.2, 0.4, 0.8 s apart), never twice at once, and the reading task
    sleeps between them (no spin)."""
    reads: list[float] = []
    asked: list[float] = []
    at_once = most_at_once = 0

    async def store(state: AnswerState) -> list[WireEvent]:
        reads.append(time.monotonic())
        return await _down(state)

    async def resend(_state: AnswerState) -> None:  # the worker has nothing more either
        nonlocal at_once, most_at_once
        asked.append(time.monotonic())
        at_once += 1
        most_at_once = max(most_at_once, at_once)
        await asyncio.sleep(0.3)  # slower than the store's first retry
        at_once -= 1

    async with _setup(nats_server, conn, store, resend) as setup:
        waits = 0
        real_wait = setup.reader._wait

        async def counted(deadline: float) -> None:
            nonlocal waits
            waits += 1
            await real_wait(deadline)

        setup.reader._wait = counted  # type: ignore[method-assign]
        await setup.gap()
        reading = setup.read()
        await asyncio.sleep(1.7)
        assert reading.texts == ["a"]
        assert 3 <= len(reads) <= 5, f"store reads at {[round(r - reads[0], 2) for r in reads]}"
        assert 1 <= len(asked) <= len(reads), (len(asked), len(reads))
        assert most_at_once == 1
        assert waits < 60, f"the reading task woke {waits} times in 1.7 s"


async def test_a_resend_and_the_stores_later_read_pass_each_event_once(
    nats_server: NatsServer, conn: Connection
) -> None:
    """The worker's resend closes the gap, then the store, back, returns the whole answer, and
    the worker's own tail comes after it: every token and the end come out exactly once."""
    reads: list[float] = []
    kept: list[WireEvent] = []
    seen: list[tuple[bool, int]] = []  # at each store read: started, positions (for a failure)

    async def store(state: AnswerState) -> list[WireEvent]:
        reads.append(time.monotonic())
        seen.append((state.started, state.positions))
        if len(reads) == 1:
            return await _down(state)
        return kept

    async with _setup(nats_server, conn, store) as setup:
        worker, w = setup.worker, setup.worker.writer
        await setup.gap()
        reading = setup.read()
        d, end = w.token("d"), w.end(finish_reason="stop", usage=Usage(completion_tokens=4))
        kept.extend([*worker.sent, d, end])
        await eventually(lambda: holds(len(reads) >= 2), 5, "the store read again")
        for event in (d, end):
            await worker.emit(event)
        await asyncio.wait_for(reading.task, 5)
        for event in kept[2:]:  # late copies of all of it from "b" on
            await worker.publish(event)
        assert await setup.reader.next(0.2) == []
        assert reading.texts == ["a", "b", "c", "d"]
        assert reading.ends == 1
        assert worker.asked, (
            f"the worker was never asked: store reads at {[round(r - reads[0], 3) for r in reads]}"
            f" saw (started, positions) {seen}; tokens read at "
            f"{ {t: round(at - reads[0], 3) for t, at in reading.at.items()} }"
        )


async def test_a_reader_whose_answer_has_not_started_asks_no_worker(
    nats_server: NatsServer, conn: Connection
) -> None:
    """The start was lost: nobody to ask (``worker_of`` needs the start's node), so the failed
    store reads ask no worker and the reader waits for the store, retrying with backoff."""
    reads, store = _failing_store()
    async with _setup(nats_server, conn, store) as setup:
        worker, w = setup.worker, setup.worker.writer
        await worker.emit(w.start(), lost=True)
        await worker.emit(w.token("a"))
        reading = setup.read()
        await eventually(lambda: holds(len(reads) >= 2), 5, "two store reads")
        await asyncio.sleep(0.05)
        assert worker.asked == []
        assert reading.texts == []


async def test_a_store_read_that_fails_after_the_answer_is_done_asks_no_worker(
    nats_server: NatsServer, conn: Connection
) -> None:
    began, fail = asyncio.Event(), asyncio.Event()

    async def store(state: AnswerState) -> list[WireEvent]:
        began.set()
        await fail.wait()  # the store read is slow; the answer ends meanwhile
        return await _down(state)

    async with _setup(nats_server, conn, store) as setup:
        worker, reader, w = setup.worker, setup.reader, setup.worker.writer
        await worker.emit(w.start())
        await worker.emit(w.token("a"))
        texts: list[str] = []
        while not texts:
            texts += [e.text for e in await reader.next(1.0) if isinstance(e, TokenEvent)]
        reader.repair_now()  # as after a reconnect: a store read begins
        assert await reader.next(0.1) == []
        await asyncio.wait_for(began.wait(), 2)
        await worker.emit(w.token("b"))
        await worker.emit(w.end(finish_reason="stop", usage=Usage(completion_tokens=2)))
        while not reader.state.done:
            texts += [e.text for e in await reader.next(1.0) if isinstance(e, TokenEvent)]
        assert texts == ["a", "b"]
        fail.set()
        await asyncio.sleep(0.2)
        assert worker.asked == [], "the worker was asked again for an answer that is whole"


async def test_a_second_gap_in_a_long_store_outage_is_asked_of_the_worker_at_once(
    nats_server: NatsServer, conn: Connection
) -> None:
    reads, store = _failing_store()
    async with _setup(nats_server, conn, store) as setup:
        worker, w = setup.worker, setup.worker.writer
        reading = setup.read()
        opened = await setup.gap()
        await eventually(lambda: holds("c" in reading.at), 5, "the first gap closed")
        assert reading.at["b"] - opened < 0.3, "the change's own case healed late"
        # The store stays down (an election of seconds): its retries back off, 0.2 s, 0.4, ...
        await eventually(lambda: holds(len(reads) >= 4), 5, "four store reads")
        await asyncio.sleep(0.1)  # the resend after it is over (the next read: 1.6 s on)
        assert worker.at_once == 0
        await worker.emit(w.token("d"), lost=True)  # a second event lost
        opened = time.monotonic()
        await worker.emit(w.token("e"))
        for n in range(200):  # the answer goes on meanwhile (no quiet spell)
            if "d" in reading.at:
                break
            await asyncio.sleep(0.05)
            await worker.emit(w.token(f"t{n}"))
        await eventually(lambda: holds("e" in reading.at), 10, "the second gap closed")
        stood = reading.at["d"] - opened
        assert stood < 0.4, f"the second gap stood {stood:.2f} s; the worker had 'd' all along"


async def test_a_gap_is_asked_of_the_worker_soon_even_while_the_store_read_hangs(
    nats_server: NatsServer, conn: Connection
) -> None:
    async def store(state: AnswerState) -> list[WireEvent]:
        await asyncio.sleep(1.0)  # store_repair's first wait (ASK_S), its ask unanswered
        return await _down(state)

    async with _setup(nats_server, conn, store) as setup:
        reading = setup.read()
        opened = await setup.gap()
        await eventually(lambda: holds("c" in reading.at), 5, "the gap closed")
        stood = reading.at["b"] - opened
        assert stood < 0.5, f"the gap stood {stood:.2f} s behind a store read that hung"
