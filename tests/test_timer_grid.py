"""Backstop timers share the process's wakeups (``mesh.timer_grid``): an edge relaying many
answers wakes for their readers' quiet-spell looks a bounded number of times a second, not once
per answer per look, and each look is late by at most one grid step.

Real nats-server; the answers are published from another thread, as a worker would publish
them, while the readers run on an event loop whose selector counts the wakeups that no socket
caused (a timer's).
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
import threading
import time

import nats
import pytest

from mesh import timer_grid
from mesh.caller_events import caller_events
from mesh.connection import Connection
from mesh.loop_lag import LoopLag
from mesh.nats_server import NatsServer
from mesh.reader import WATCH_QUIET_S, AnswerReader
from mesh.timer_grid import GRID_S, SLACK, coalesced, on_grid
from protocol.codec import WireFormat, dump_event
from protocol.errors import DeadlineExceededError, MeshTimeoutError
from protocol.messages import TokenEvent, WireEvent
from protocol.stream import AnswerState, AnswerWriter
from tests.conftest import make_settings

READERS = 16
TOKEN_GAP_S = 0.04
TOKENS = 50  # 2 s of tokens per answer


def _on_grid(when: float) -> bool:
    return abs(when / GRID_S - round(when / GRID_S)) < 1e-6


def test_a_long_wait_moves_to_the_grid_and_a_short_one_keeps_its_time() -> None:
    now = 1000.013
    for wait in (0.25, 0.5, 1.0, 2.37):
        when = coalesced(now, now + wait)
        assert _on_grid(when), (wait, when)
        assert now + wait <= when <= now + wait + GRID_S, (wait, when)
    # A few milliseconds (a first resend's backoff): the grid would more than double it.
    assert coalesced(now, now + 0.004) == now + 0.004
    # In between, only when the grid point is within SLACK of the wait.
    for wait in (0.03, 0.07, 0.11, 0.15):
        when = coalesced(now, now + wait)
        assert when == now + wait or (_on_grid(when) and when - (now + wait) <= wait * SLACK)
    assert coalesced(now, now + 0.25, exact=now + 0.26) == now + 0.26  # never past a deadline


def test_a_grid_point_is_its_own_and_a_timer_due_on_one_keeps_it() -> None:
    """``k * GRID_S / GRID_S`` may read a hair over ``k``: rounding it up would move a timer due
    on a grid point a whole step later (review of b3ce8d3: 3284 of 40000 points did)."""
    for k in itertools.chain(range(40000), range(10**8, 10**8 + 2000)):  # up to 58 days up
        point = on_grid((k + 0.5) * GRID_S)
        assert on_grid(point) == point, (k, point)
    when = 24576 * GRID_S  # 1228.8000000000002
    assert coalesced(when - 0.3, when) - when < 1e-6


class _CountingSelector(selectors.EpollSelector):
    """Counts the times the loop slept and woke with no socket ready: a timer woke it."""

    def __init__(self) -> None:
        super().__init__()
        self.timer_wakeups = 0
        self.counting = False

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(timeout)
        if self.counting and not ready and timeout is not None and timeout > 0:
            self.timer_wakeups += 1
        return ready


class _Passer:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.last_at = 0.0  # when the last token came

    def ready(self) -> bool:
        return True

    def take(self, tokens: list[TokenEvent]) -> None:
        self.texts += [t.text for t in tokens]
        self.last_at = time.monotonic()

    def take_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        self.texts.append(text)
        self.last_at = time.monotonic()


def _publish(url: str, started: threading.Event) -> float:
    """Each answer's start, then a token every TOKEN_GAP_S per answer, the answers' tokens
    spread evenly over the gap (as many streams' tokens come); the time the last one went."""

    async def run() -> float:
        nc = await nats.connect(url)
        writers = [AnswerWriter(f"r{i}", attempt=1, node="cloud:w1") for i in range(READERS)]
        try:
            for i, w in enumerate(writers):
                await nc.publish(f"grid.r{i}", dump_event(w.start(), WireFormat.MSGPACK))
            await nc.flush()
            started.wait(10)
            for n in range(TOKENS):
                for i, w in enumerate(writers):
                    event = dump_event(w.token(f"t{n}"), WireFormat.MSGPACK)
                    await nc.publish(f"grid.r{i}", event)
                    await nc.flush()
                    await asyncio.sleep(TOKEN_GAP_S / READERS)
            return time.monotonic()
        finally:
            await nc.close()

    return asyncio.run(run())


def test_many_answers_quiet_spell_looks_wake_the_loop_about_once_a_grid_step(
    nats_server: NatsServer,
) -> None:
    """16 answers at 25 tokens/s each, for 2 s, and the process's loop-lag ticker: each
    reader's look after a quarter second of quiet moves with every token (about four timers a
    second each, 64 in all), and the ticker ticks 20 times a second. On the grid they share
    wakeups: at most about one per grid step, where each on its own woke the loop 100 times a
    second. Once the tokens stop, every reader's watch asks within one grid step of its
    quiet spell."""
    selector = _CountingSelector()
    asked: dict[int, float] = {}
    passers: list[_Passer] = []

    async def main() -> tuple[int, float]:
        started = threading.Event()
        async with Connection(make_settings(nats_server.url).nats, "grid-test") as conn:
            readers = []
            for i in range(READERS):

                async def watch(_state: AnswerState, i: int = i) -> list[WireEvent]:
                    asked.setdefault(i, time.monotonic())
                    return []

                reader = AnswerReader(conn, AnswerState(f"r{i}"), None, what="w", watch=watch)
                passer = _Passer()
                reader.pass_tokens(passer)
                await reader.subscribe(f"grid.r{i}")
                readers.append(reader)
                passers.append(passer)
            await conn.nc.flush()
            lag = LoopLag("test")
            ticking = asyncio.create_task(lag.run())
            publishing = asyncio.create_task(asyncio.to_thread(_publish, nats_server.url, started))

            async def follow(i: int) -> None:  # as the edge's relay: until the watch asks
                while i not in asked:
                    tokens = [e for e in await readers[i].next(1.0) if isinstance(e, TokenEvent)]
                    if tokens:
                        passers[i].take(tokens)

            for reader in readers:  # each answer's start, the usual way
                assert [type(e).__name__ for e in await reader.next(5.0)] == ["StartEvent"]
            following = [asyncio.create_task(follow(i)) for i in range(READERS)]
            selector.counting = True
            began = time.monotonic()
            started.set()
            await publishing
            selector.counting = False
            seconds = time.monotonic() - began
            await asyncio.wait_for(asyncio.gather(*following), 5)
            ticking.cancel()
            for reader in readers:
                await reader.close()
            for i, passer in enumerate(passers):
                assert passer.texts == [f"t{n}" for n in range(TOKENS)], i
            return selector.timer_wakeups, seconds

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        wakeups, seconds = runner.run(main())
    print(f"{wakeups} timer wakeups in {seconds:.2f} s")
    # One per grid step at most, and a few for the publisher's own start (its thread's loop
    # is not counted; this loop's to_thread hand-over is).
    assert wakeups <= seconds / GRID_S * 1.2 + 4, f"{wakeups} timer wakeups in {seconds:.1f} s"
    # Each watch asks once its answer was quiet for WATCH_QUIET_S, never before, and within a
    # grid step of it (and up to 50 ms of the loop's own delay on a busy machine).
    lates = sorted(asked[i] - passers[i].last_at - WATCH_QUIET_S for i in range(READERS))
    assert lates[0] >= -0.002, lates
    assert lates[-1] <= GRID_S + 0.05, lates


async def _at_grid_phase(after: float) -> None:
    """Until the loop time is ``after`` seconds past a grid point (within a millisecond)."""
    loop = asyncio.get_running_loop()
    while True:
        point = on_grid(loop.time())
        await asyncio.sleep(max(0.0, point + after - loop.time()))
        if abs(loop.time() - (point + after)) < 0.001:
            return


async def test_a_callers_deadline_and_first_event_timeout_keep_their_time(
    conn: Connection,
) -> None:
    """A request's deadline is no backstop: its typed error comes at it, not at the grid point
    after it (review of b3ce8d3: 49 ms late for a deadline 2 ms past a point); the SDK's
    first-event timeout likewise."""
    loop = asyncio.get_running_loop()
    reader = AnswerReader(conn, AnswerState("dl"), None, what="w")
    await reader.subscribe("grid.deadline")
    try:
        await _at_grid_phase(0.002)
        ends_at = loop.time() + 0.3  # 2 ms past a grid point
        with pytest.raises(DeadlineExceededError):
            async for _ in caller_events(reader, time.time() + 0.3, 60.0, 60.0):
                pass
        late = loop.time() - ends_at
        assert late < 0.02, f"the deadline's error came {late * 1000:.1f} ms after it"
        await _at_grid_phase(0.002)
        began = loop.time()
        with pytest.raises(MeshTimeoutError):
            async for _ in caller_events(reader, None, 0.3, 60.0):
                pass
        late = loop.time() - began - 0.3
        assert late < 0.02, f"the first-event timeout came {late * 1000:.1f} ms late"
    finally:
        await reader.close()


async def test_the_loop_lag_ticker_ticks_on_every_grid_point_and_wakes_from_idle() -> None:
    """Busy: a tick every 50 ms, none skipped; idle: every 250 ms; ``wake()``: the next tick
    within the interval and half a step."""
    ticks: list[float] = []
    busy = [True]
    lag = LoopLag("t", busy=lambda: busy[0], on_tick=ticks.append)
    running = asyncio.create_task(lag.run())
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(1.0)
        busy_ticks = list(ticks)
        busy[0] = False
        await asyncio.sleep(0.8)
        idle_ticks = ticks[len(busy_ticks) :]
        woke = loop.time()
        lag.wake()
        due = lag.next_due
        assert due is not None
        assert woke + 0.025 - 1e-6 <= due <= woke + 0.075 + 1e-6, due - woke
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    # Medians: a tick the loop ran late moves one gap, not the pace (a skipped point: ~0.1 s).
    offsets = sorted(abs(t / GRID_S - round(t / GRID_S)) for t in busy_ticks)
    assert offsets[len(offsets) // 2] < 0.2, busy_ticks
    gaps = sorted(b - a for a, b in itertools.pairwise(busy_ticks))
    assert len(busy_ticks) >= 17 and gaps[len(gaps) // 2] < 0.07, gaps
    idle_gaps = [b - a for a, b in itertools.pairwise(idle_ticks[1:])]
    assert idle_gaps and all(0.2 < g < 0.3 for g in idle_gaps), idle_gaps


def test_the_wakeup_count_fails_without_the_grid(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wakeup test above, with every timer at its own time (as before the grid): it
    fails (review of b3ce8d3: 176 wakeups in 2.9 s, against about 42)."""
    monkeypatch.setattr(timer_grid, "on_grid", lambda when: when)
    monkeypatch.setattr(LoopLag, "_next", lambda self, now, interval: now + interval)
    with pytest.raises(AssertionError, match="timer wakeups"):
        test_many_answers_quiet_spell_looks_wake_the_loop_about_once_a_grid_step(nats_server)
