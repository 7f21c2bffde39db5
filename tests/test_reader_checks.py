"""A reader's checks (asking the worker whether it is there, reading the answer store) wait on
other processes: up to a second when a worker is moving between servers in a rolling restart, a
store read up to its timeout while the stream elects a leader. Tokens that come meanwhile go on
at once; they used to wait for the check (a 1 s freeze seen in the lame-duck restart test).

Real nats-server; the events are published on a plain connection as a worker publishes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable

import nats
import pytest

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.reader import OFFLINE_LOOK_S, WATCH_QUIET_S, AnswerReader
from mesh.testing.proxy import TcpProxy
from protocol.codec import WireFormat, dump_event
from protocol.messages import TokenEvent, Usage, WireEvent
from protocol.stream import AnswerState, AnswerWriter
from tests.conftest import make_settings
from tests.helpers import eventually

SUBJECT = "mesh.v1.tok.checks.r1"
CHECK_S = 3.0
"""How long each slow check takes: far longer than any token may wait."""


class _Slow:
    """A check that takes CHECK_S, as one whose request goes unanswered until its timeout."""

    def __init__(self) -> None:
        self.began = asyncio.Event()
        self.ended = 0

    async def __call__(self, _state: AnswerState) -> list[WireEvent]:
        self.began.set()
        await asyncio.sleep(CHECK_S)
        self.ended += 1
        return []


async def _tokens_during_a_check(
    server: NatsServer, reader: AnswerReader, check: _Slow, pause: float
) -> tuple[list[str], float]:
    """Start and two tokens; a pause of ``pause`` s (the check begins); three more tokens.
    The texts read, and how long after their publish the last token came out of next()."""
    writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
    await reader.subscribe(SUBJECT)
    await reader.conn.nc.flush()
    worker = await nats.connect(server.url)
    texts: list[str] = []

    async def send(events: list[WireEvent]) -> None:
        for event in events:
            await worker.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
        await worker.flush()

    async def read(until: int) -> None:
        while len(texts) < until:
            for event in await reader.next(0.1):
                if isinstance(event, TokenEvent):
                    texts.append(event.text)

    try:
        await send([writer.start(), writer.token("a"), writer.token("b")])
        await asyncio.wait_for(read(2), 5)
        reading = asyncio.create_task(read(5))
        await asyncio.wait_for(check.began.wait(), pause + 2)  # it begins after the pause
        sent = time.monotonic()
        await send([writer.token("c"), writer.token("d"), writer.token("e")])
        await asyncio.wait_for(reading, CHECK_S + 5)
        return texts, time.monotonic() - sent
    finally:
        await worker.close()
        await reader.close()


async def test_tokens_go_on_while_the_reader_asks_after_the_worker(
    nats_server: NatsServer, conn: Connection
) -> None:
    check = _Slow()
    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=check)
    texts, waited = await _tokens_during_a_check(nats_server, reader, check, WATCH_QUIET_S)
    assert texts == ["a", "b", "c", "d", "e"]
    assert waited < CHECK_S / 3, f"tokens waited {waited:.2f} s for the worker check"
    assert check.ended == 0, "the check had ended: the test proves nothing"


async def test_tokens_go_on_while_the_reader_reads_the_answer_store(
    nats_server: NatsServer, conn: Connection
) -> None:
    check = _Slow()
    reader = AnswerReader(conn, AnswerState("r1"), check, what="the cloud")
    # A quiet spell (1 s) starts a store read, in case the tail was lost.
    texts, waited = await _tokens_during_a_check(nats_server, reader, check, 1.0)
    assert texts == ["a", "b", "c", "d", "e"]
    assert waited < CHECK_S / 3, f"tokens waited {waited:.2f} s for the store read"
    assert check.ended == 0, "the check had ended: the test proves nothing"


async def test_a_closed_reader_stops_its_checks(nats_server: NatsServer, conn: Connection) -> None:
    check = _Slow()
    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=check)
    await _tokens_during_a_check(nats_server, reader, check, WATCH_QUIET_S)
    await asyncio.sleep(0.05)
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert not [t for t in tasks if "_Slow" in repr(t.get_coro())], tasks


class _Waits:
    """Counts the times a reader's task goes to sleep in :meth:`AnswerReader.next`."""

    def __init__(self, reader: AnswerReader) -> None:
        self.count = 0
        real_wait = reader._wait

        async def counted(deadline: float) -> None:
            self.count += 1
            await real_wait(deadline)

        reader._wait = counted  # type: ignore[method-assign]


class _Collect:
    """A passer that takes every in-order token (as an edge relaying to NATS clients)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ready(self) -> bool:
        return True

    def take(self, tokens: list[TokenEvent]) -> None:
        self.texts += [t.text for t in tokens]

    def take_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        self.texts.append(text)


async def test_tokens_passed_on_do_not_wake_the_reading_task_until_the_answer_goes_quiet(
    nats_server: NatsServer, conn: Connection
) -> None:
    """While tokens go on from the callback, the watch's quiet spell keeps moving: the waiting
    task is not woken to find that out (one wait for the whole stream), and the watch still
    asks after the worker once the tokens stop."""
    asked: list[float] = []

    async def watch(_state: AnswerState) -> list[WireEvent]:
        asked.append(time.monotonic())
        return []

    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=watch)
    passer = _Collect()
    reader.pass_tokens(passer)
    waits = _Waits(reader)
    await reader.subscribe(SUBJECT)
    await conn.nc.flush()
    worker = await nats.connect(nats_server.url)
    writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
    try:
        await worker.publish(SUBJECT, dump_event(writer.start(), WireFormat.MSGPACK))
        await worker.flush()
        started = await reader.next(1.0)  # the start goes the usual way
        assert [type(e).__name__ for e in started] == ["StartEvent"]
        waits.count = 0
        reading = asyncio.create_task(reader.next(10.0))

        for i in range(60):  # 1.2 s of tokens, 20 ms apart: never quiet for WATCH_QUIET_S
            await worker.publish(SUBJECT, dump_event(writer.token(f"t{i}"), WireFormat.MSGPACK))
            await worker.flush()
            await asyncio.sleep(0.02)
        last = time.monotonic()
        assert not reading.done(), "the reading task returned while tokens went on"
        assert await asyncio.wait_for(reading, 5) == []  # after the watch asked
        assert passer.texts == [f"t{i}" for i in range(60)]
        assert len(asked) == 1 and asked[0] - last >= WATCH_QUIET_S - 0.05, (asked, last)
        # One wait while the tokens went on, one while the watch's check ran.
        assert waits.count == 2, f"the reading task was woken {waits.count - 2} times for nothing"
    finally:
        await worker.close()
        await reader.close()


def _is(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return check()

    return probe


async def test_a_reader_cut_off_does_not_spin_and_asks_after_the_worker_once_the_link_is_back(
    nats_server: NatsServer,
) -> None:
    """A started answer goes quiet because the link is cut: the watch cannot ask anyone, so the
    reading task looks again every OFFLINE_LOOK_S (it used to wake every millisecond for the
    whole cut), and asks after the worker as soon as the link is back."""
    proxy = await TcpProxy(nats_server.port).start()
    settings = make_settings(proxy.url)
    settings.nats.reconnect_wait = 0.1
    asked: list[float] = []

    async def watch(_state: AnswerState) -> list[WireEvent]:
        asked.append(time.monotonic())
        return []

    worker = await nats.connect(nats_server.url)
    try:
        async with Connection(settings.nats, "cut-reader") as conn:
            reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=watch)
            waits = _Waits(reader)
            await reader.subscribe(SUBJECT)
            await conn.nc.flush()
            await worker.flush()  # not at once: see tests/test_inline_sub.py
            writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
            await worker.publish(SUBJECT, dump_event(writer.start(), WireFormat.MSGPACK))
            await worker.flush()
            assert [type(e).__name__ for e in await reader.next(2.0)] == ["StartEvent"]

            proxy.cut(30.0)
            await eventually(_is(lambda: not conn.connected), 5, "the link cut")
            asked.clear()
            waits.count = 0
            cut_for = 1.0
            assert await reader.next(cut_for) == []
            assert asked == [], "the watch asked over a cut link"
            assert waits.count <= cut_for / OFFLINE_LOOK_S + 5, f"{waits.count} wakeups"

            back: list[float] = []

            async def stamp() -> None:
                back.append(time.monotonic())

            conn.on_reconnect("stamp", stamp)
            reading = asyncio.create_task(reader.next(5.0))  # reading when the link comes back
            proxy.restore()
            await eventually(_is(lambda: bool(asked)), 10, "the watch asking after the worker")
            assert back, "the watch asked before the link was back"
            heal = asked[0] - back[0]
            assert heal < 0.5, f"the watch asked {heal:.2f} s after the link was back"
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            await reader.close()
    finally:
        await worker.close()
        await proxy.stop()


async def test_a_tail_lost_in_a_reconnect_is_fetched_at_once_not_after_a_quiet_spell(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link drops while the answer's last events are published: nothing later comes to
    show the gap. The reconnect itself is the event: the reader fetches what was kept as soon
    as the link is back, waiting neither for a message nor for a quiet spell (it used to wait
    the spell, 1 s: a lame-duck restart test saw an answer stand still for 1.00 s)."""
    monkeypatch.setattr("mesh.reader._QUIET_FIRST_S", 30.0)  # only the event can explain a heal
    proxy = await TcpProxy(nats_server.port).start()
    settings = make_settings(proxy.url)
    settings.nats.reconnect_wait = 0.1
    writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
    head = [writer.start(), writer.token("a")]
    tail = [writer.token("b"), writer.end(finish_reason="stop", usage=Usage(completion_tokens=2))]
    repaired: list[float] = []

    async def store(_state: AnswerState) -> list[WireEvent]:  # what the answer store kept
        repaired.append(time.monotonic())
        return head + tail

    worker = await nats.connect(nats_server.url)
    try:
        async with Connection(settings.nats, "tail-reader") as conn:
            reader = AnswerReader(conn, AnswerState("r1"), store, what="the cloud")
            await reader.subscribe(SUBJECT)
            await conn.nc.flush()
            await worker.flush()  # not at once: see tests/test_inline_sub.py
            for event in head:
                await worker.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
            await worker.flush()
            got: list[WireEvent] = []
            while len(got) < 2:
                got += await reader.next(2.0)
            reading = asyncio.create_task(reader.next(20.0))  # waiting when the link drops
            proxy.cut(30.0)
            await eventually(_is(lambda: not conn.connected), 5, "the link cut")
            for event in tail:  # the reader's link is down: it never sees these
                await worker.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
            await worker.flush()
            back: list[float] = []

            async def stamp() -> None:
                back.append(time.monotonic())

            conn.on_reconnect("stamp", stamp)
            proxy.restore()
            got += await asyncio.wait_for(reading, 15)
            assert [type(e).__name__ for e in got] == [
                "StartEvent",
                "TokenEvent",
                "TokenEvent",
                "EndEvent",
            ], got
            assert back and repaired, (back, repaired)
            heal = repaired[-1] - back[0]
            print(f"\nthe link back -> the store read: {heal:.3f} s")
            assert heal < 0.5, f"the store was read {heal:.2f} s after the link was back"
            await reader.close()
    finally:
        await worker.close()
        await proxy.stop()


async def test_a_reader_read_token_by_token_keeps_one_timer_and_still_watches_on_time(
    nats_server: NatsServer, conn: Connection
) -> None:
    """An SDK reads each token through next(), one wait per token. The wait's timer outlives
    it: 60 tokens 20 ms apart set a handful of timers, not one each, and once the tokens stop
    the watch asks after the worker after its quiet spell (and again each quiet spell after),
    as before."""
    asked: list[float] = []

    async def watch(_state: AnswerState) -> list[WireEvent]:
        asked.append(time.monotonic())
        return []

    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=watch)
    loop = asyncio.get_running_loop()
    timers = 0
    real_call_at = loop.call_at  # call_later goes through it too

    def call_at(
        when: float, callback: Callable[..., object], *args: object, **kw: object
    ) -> object:
        nonlocal timers
        timers += callback == reader._on_timer
        return real_call_at(when, callback, *args, **kw)  # type: ignore[arg-type]

    await reader.subscribe(SUBJECT)
    await conn.nc.flush()
    worker = await nats.connect(nats_server.url)
    writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
    texts: list[str] = []

    async def read() -> None:
        while len(texts) < 60:
            texts.extend(e.text for e in await reader.next(5.0) if isinstance(e, TokenEvent))

    try:
        await worker.publish(SUBJECT, dump_event(writer.start(), WireFormat.MSGPACK))
        await worker.flush()
        assert [type(e).__name__ for e in await reader.next(1.0)] == ["StartEvent"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(loop, "call_at", call_at)
            reading = asyncio.create_task(read())
            for i in range(60):  # 1.2 s of tokens, 20 ms apart
                await worker.publish(SUBJECT, dump_event(writer.token(f"t{i}"), WireFormat.MSGPACK))
                await worker.flush()
                await asyncio.sleep(0.02)
            last = time.monotonic()
            await asyncio.wait_for(reading, 5)
            set_while_reading = timers
            assert await reader.next(3 * WATCH_QUIET_S) == []  # quiet: the watch asks meanwhile
        assert texts == [f"t{i}" for i in range(60)]
        assert set_while_reading <= 6, f"{set_while_reading} timers for 60 tokens"
        assert asked, "the watch never asked after the worker"
        assert WATCH_QUIET_S - 0.05 <= asked[0] - last < WATCH_QUIET_S + 0.5, (asked[0], last)
        assert all(b - a >= WATCH_QUIET_S - 0.05 for a, b in itertools.pairwise(asked)), asked
    finally:
        await worker.close()
        await reader.close()
