"""How late a process's event loop runs what is due: whether the process keeps up.

A node does everything on one event loop. When the loop has more to do than one core gives it
(a worker relaying an engine faster than its CPU can publish, an edge with too many streams),
every callback waits in line: tokens reach clients late, by as much as the loop is behind. A
timer that asks to wake every ``interval`` and notes how much later it woke measures exactly
that wait, for about 20 wakeups a second while the process has work.

With nothing to do (``busy`` says so) it ticks every :data:`IDLE_INTERVAL_S` instead, and
:meth:`LoopLag.wake` brings the next tick back to ``interval`` as soon as work comes. An idle
edge woke 23 times a second, 20 of them for this ticker; a wakeup costs little work, but an idle
daemon on a laptop or a Jetson should let its core sleep (``docs/performance.md``). A process
whose ticks count stand-stills (the worker's :class:`cloud_node.progress.LoopStalls`) passes no
``busy``: a freeze while idle must still be seen, so it ticks every ``interval`` always.

``lag`` is the worst lateness in the last ``window`` seconds; ``behind`` says it is over
``behind_s``. It clears by itself once the loop catches up (within ``window``).

The ticks are one timer callback each, not a task woken from ``asyncio.sleep`` (a future, a
timer and a task step per tick), and other watches of the loop listen to the same ticks
(``on_tick``) instead of keeping a ticker of their own: the worker's stand-still count
(:class:`cloud_node.progress.LoopStalls`) did. An idle edge's samples outside ``epoll_wait``
fell from 57 to 33 in 10 s (py-spy); an idle worker's CPU did not move beyond its spread, most
of it being elsewhere (``docs/performance.md``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from mesh.logs import get_logger

log = get_logger(__name__)

INTERVAL_S = 0.05
IDLE_INTERVAL_S = 0.25
"""The ticker's interval while ``busy`` says there is no work. A request that comes while the
loop is held waits for it before anything can call :meth:`LoopLag.wake`, so the idle ticks must
still see such a hold: any of 0.3 s or more is (review S23a: at 1 s, a 0.4 s hold that delayed
a request by as much was seen in 7 of 12 trials). Shorter ones while idle are seen when a tick
falls in them (a fraction (hold - 0.05 s) / 0.25 s of them, review S23c), and a hold's lag is
read short by up to 0.2 s: a tick due 0.25 s into a 0.4 s hold reads 0.15 s."""
WINDOW_S = 5.0
BEHIND_S = 0.05
"""Late by this much, tokens are visibly late: a stream at 20-50 tokens/s has 20-50 ms between
tokens. A loop that keeps up is late by well under a millisecond."""


class LoopLag:
    def __init__(
        self,
        what: str,
        *,
        interval: float = INTERVAL_S,
        window: float = WINDOW_S,
        behind_s: float = BEHIND_S,
        advice: str = "",
        on_tick: Callable[[float], None] | None = None,
        busy: Callable[[], bool] | None = None,
        idle_interval: float = IDLE_INTERVAL_S,
    ) -> None:
        """``on_tick(now)``: called on each tick too (``now``: ``loop.time()``). ``busy``:
        whether the process has work; while it has none, ticks come every ``idle_interval``
        (None: always every ``interval``)."""
        self.what = what
        self.on_tick = on_tick
        self.busy = busy
        self.interval = interval
        self.idle_interval = max(interval, idle_interval)
        self.window = window
        self.behind_s = behind_s
        self.advice = advice
        self._late: deque[tuple[float, float]] = deque()  # (when, how late), oldest first
        self._behind = False
        self._handle: asyncio.TimerHandle | None = None

    @property
    def lag(self) -> float:
        """Seconds: the worst lateness within the last ``window`` seconds."""
        self._forget(time.monotonic())
        return self._late[0][1] if self._late else 0.0  # the front is the window's worst

    @property
    def behind(self) -> bool:
        return self.lag >= self.behind_s

    @property
    def next_due(self) -> float | None:
        """The loop time of the next tick (None: the ticker does not run)."""
        return None if self._handle is None else self._handle.when()

    def wake(self) -> None:
        """Work came: the next tick comes within ``interval``, not at the idle interval (a
        call per request; nothing to do while the ticker is at its usual pace)."""
        handle = self._handle
        if handle is None:
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval
        if handle.when() > due:
            handle.cancel()
            self._handle = loop.call_at(due, self._tick, loop, due)

    def stats(self) -> dict[str, float | bool]:
        """What a node's STATS (and ``mesh status``) carry of it."""
        lag = self.lag
        return {"loop_lag_ms": round(lag * 1000, 1), "behind": lag >= self.behind_s}

    def note(self, late: float, now: float | None = None) -> None:
        """One wakeup ``late`` seconds after it was due."""
        now = time.monotonic() if now is None else now
        self._forget(now)
        while self._late and self._late[-1][1] <= late:
            self._late.pop()  # never again the worst while this one is in the window
        self._late.append((now, late))
        behind = self._late[0][1] >= self.behind_s
        if behind != self._behind:
            self._behind = behind
            if behind:
                log.warning(
                    f"{self.what} cannot keep up: its event loop runs late",
                    late_ms=round(self._late[0][1] * 1000, 1),
                    advice=self.advice or None,
                )
            else:
                log.info(f"{self.what} keeps up again", lag_ms=round(self._late[0][1] * 1000, 1))

    def _forget(self, now: float) -> None:
        while self._late and self._late[0][0] < now - self.window:
            self._late.popleft()

    async def run(self) -> None:
        """Tick every ``interval`` until cancelled."""
        loop = asyncio.get_running_loop()
        due = loop.time() + self.interval
        self._handle = loop.call_at(due, self._tick, loop, due)
        try:
            await loop.create_future()  # the ticks are timer callbacks: nothing to do here
        finally:
            if self._handle is not None:
                self._handle.cancel()
                self._handle = None  # a wake() after the stop sets nothing

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        interval = self.interval
        try:
            self.note(max(0.0, now - due), now)
            if self.on_tick is not None:
                self.on_tick(now)
            if self.busy is not None and not self.busy():
                interval = self.idle_interval
        finally:  # a listener that raises (the loop logs it) does not stop the ticks
            due = now + interval
            self._handle = loop.call_at(due, self._tick, loop, due)
