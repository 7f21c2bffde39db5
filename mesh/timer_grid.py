"""Periodic timers that wake the event loop together.

A node keeps timers that are not expected to do much when they fire: the process's loop-lag
tick (:mod:`mesh.loop_lag`, 20 times a second), a worker's capacity poll (4 a second) and each
answer's progress reports (about once a second each). Each one that falls due while the loop
sleeps wakes the process on its own, and a wakeup costs far more than the callback: on this
project's machine a process doing nothing but a 20 Hz timer is charged 18.6 ms of CPU a second,
against 2.3 with none (``docs/performance.md``).

So those timers fall on one grid of loop times, :data:`GRID_S` apart, where the loop-lag ticks
fall too: all that are due within one step fire in one wakeup. A pause moves to the grid point
after it only when that delays it by at most :data:`SLACK` of its wait (:func:`coalesced`): a
quarter-second poll ends up to 50 ms late, a wait of a few milliseconds keeps its time.

An answer reader's timers (a look at the answer's worker after a quiet spell, re-armed about
four times a second while tokens flow) are not on the grid. On it, an edge relaying 32 answers
woke a third less and spent 11 to 28% less CPU a token, but every way of putting them there
that was tried cost healing: a look up to 50 ms late made the fallback from a stalled engine
0.25 s later (2.02 -> 2.27 s), and looks kept on time beside grid timers left an answer
standing still 0.23 or 0.63 s after a hub's stream leader was killed in 3 of 8 runs, against
none in 11 runs with all on time or all on the grid (``docs/performance.md``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

GRID_S = 0.05
"""The grid's step: the loop-lag ticker's interval while a node has work."""
SLACK = 0.25
"""How late, as a share of its wait, a timer may fire to share a wakeup."""
_HAIR = 1e-6
"""A share of a step (50 ns) under which ``when`` counts as the grid point before it: more than
the float error of ``when / GRID_S`` for loop times (seconds since boot) of years."""


def on_grid(when: float) -> float:
    """The first grid point at or after loop time ``when`` (a grid point itself, as this
    computes it, is its own: ``k * GRID_S`` divided by ``GRID_S`` may read a hair over ``k``)."""
    return math.ceil(when / GRID_S - _HAIR) * GRID_S


def coalesced(now: float, when: float) -> float:
    """When a pause due to end at ``when`` (set at ``now``, loop times) ends: the grid point
    after it, where that delays it by no more than :data:`SLACK` of its wait; else ``when``."""
    point = on_grid(when)
    return point if point - when <= (when - now) * SLACK else when


def call_coalesced(
    loop: asyncio.AbstractEventLoop, delay: float, callback: Callable[..., object], *args: Any
) -> asyncio.TimerHandle:
    """``loop.call_later(delay, callback, *args)``, moved to the grid by :func:`coalesced`."""
    now = loop.time()
    return loop.call_at(coalesced(now, now + delay), callback, *args)


async def sleep(delay: float) -> None:
    """``asyncio.sleep(delay)``, woken at the time :func:`coalesced` gives (a periodic task's
    pause: a poll, a progress report)."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    woken = loop.create_future()
    handle = loop.call_at(coalesced(now, now + delay), _done, woken)
    try:
        await woken
    finally:
        handle.cancel()


def _done(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
