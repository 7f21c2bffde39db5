"""Periodic timers share the process's wakeups (``mesh.timer_grid``): a worker's polls and
progress reports and its loop-lag ticks wake its loop about once a grid step, however many
answers it serves; a reader's deadline keeps its time.

The loop runs on a selector that counts the wakeups no socket caused (a timer's).
"""

from __future__ import annotations

import asyncio
import itertools
import selectors
import time

import pytest

from mesh import timer_grid
from mesh.caller_events import caller_events
from mesh.connection import Connection
from mesh.loop_lag import LoopLag
from mesh.reader import AnswerReader
from mesh.timer_grid import GRID_S, SLACK, coalesced, on_grid
from protocol.errors import DeadlineExceededError, MeshTimeoutError
from protocol.stream import AnswerState


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


PAUSERS = 40
PAUSE_S = 0.25
RUN_S = 2.0


def test_periodic_pauses_and_the_loop_lag_ticks_wake_the_loop_about_once_a_grid_step() -> None:
    """40 answers' progress reports and polls (a pause of a quarter second each, started at
    random phases) and the loop-lag ticker, for 2 s: on their own they would wake the loop
    about 180 times a second; on the grid, once a step at most (20 a second)."""
    selector = _CountingSelector()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        lag = LoopLag("test")
        ticking = asyncio.create_task(lag.run())
        stop = loop.time() + RUN_S

        async def pauser(i: int) -> None:
            await asyncio.sleep(PAUSE_S * i / PAUSERS)  # spread over the pause, as answers are
            while loop.time() < stop:
                await timer_grid.sleep(PAUSE_S)

        pausing = asyncio.gather(*(pauser(i) for i in range(PAUSERS)))
        await asyncio.sleep(PAUSE_S + 0.01)  # every pauser past its start (its own wakeup)
        selector.counting = True
        began = loop.time()
        await pausing
        selector.counting = False
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        return loop.time() - began

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        seconds = runner.run(main())
    wakeups = selector.timer_wakeups
    print(f"{wakeups} timer wakeups in {seconds:.2f} s")
    assert wakeups <= seconds / GRID_S * 1.2 + 4, f"{wakeups} timer wakeups in {seconds:.1f} s"


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


def test_the_wakeup_count_fails_without_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wakeup test above, with every timer at its own time: it fails."""
    monkeypatch.setattr(timer_grid, "on_grid", lambda when: when)
    monkeypatch.setattr(LoopLag, "_next", lambda self, now, interval: now + interval)
    with pytest.raises(AssertionError, match="timer wakeups"):
        test_periodic_pauses_and_the_loop_lag_ticks_wake_the_loop_about_once_a_grid_step()
