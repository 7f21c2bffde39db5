"""Backstop timers that wake the event loop together.

A node keeps timers that are not expected to fire while its work goes well: each answer
reader's look after a quiet spell (re-armed about four times a second while tokens flow, since
each token moves it), its caller's deadline, and the process's loop-lag tick. Each one that
falls due while the loop sleeps wakes the process on its own. Waking costs far more than the
callback: on this project's machine a process doing nothing but a 20 Hz timer is charged
18.6 ms of CPU a second, against 2.3 with none (``docs/performance.md``). An edge relaying 32
answers woke for such timers about as often as for the tokens themselves.

So those timers fall on one grid of loop times, :data:`GRID_S` apart: all that fall due within
one step fire in one wakeup, together with the loop-lag tick (:mod:`mesh.loop_lag`, which ticks
on the grid). A timer moves to the grid only when that delays it by at most :data:`SLACK` of its
wait: a look after a quarter second of quiet fires up to 50 ms late, a wait of a few
milliseconds (a resend's first backoff) keeps its time.
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


def coalesced(now: float, when: float, exact: float | None = None) -> float:
    """When a timer due at ``when`` (set at ``now``, loop times) fires: the grid point after it,
    where that delays it by no more than :data:`SLACK` of its wait; else ``when`` itself. Never
    after ``exact`` (a deadline), when given."""
    point = on_grid(when)
    fire = point if point - when <= (when - now) * SLACK else when
    return fire if exact is None else min(fire, max(exact, when))


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
