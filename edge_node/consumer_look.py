"""Looking for a JetStream consumer across an edge site's uplink (:mod:`edge_node.site_links`).

A look (``CONSUMER.INFO``) sent into a silent uplink is lost without a word, and waiting out its
request timeout held a site's loop for seconds after the uplink carried again. So a look left
unanswered for a while gets another beside it, and a forward that reaches the hub (the uplink
carries) sends one at once. The first look stays until its own timeout, so that a hub slow to
answer is still heard; the others are at most :data:`MAX_LOOKS` in all, the oldest of them let go
first, and never more than one each :data:`LOOK_GAP_S`, however many forwards go by.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.js.errors import APIError, ServiceUnavailableError

from mesh.logs import get_logger
from mesh.pull import MAX_RTT_S
from mesh.tasks import raise_if_cancelled

log = get_logger(__name__)
LOOK_S = 0.5
"""How long a look goes unanswered before another goes beside it; more on a slow uplink: two of
the last look's round trips (counted up to :data:`mesh.pull.MAX_RTT_S`: a round trip measured
across a stall says nothing of the link), at most half the request timeout."""
MAX_LOOKS = 4
"""Looks waiting at once, at most."""
LOOK_GAP_S = 0.1
"""The least time between two looks."""
FIRST_PAUSE_S = 0.1
"""The first pause after a look that failed outright; it doubles up to the caller's
``most_pause`` when the hub said the consumer is not there, up to :data:`REFUSED_PAUSE_S`
when nobody answered (a leaf refuses at once while its uplink is down: a look costs the hub
nothing then, and one right after the uplink links again finds the consumer at once)."""
REFUSED_PAUSE_S = 0.25

Look = Callable[[], Awaitable[Any]]


async def until_there(
    look: Look,
    name: str,
    *,
    rtt: float,
    timeout: float,
    reached: Callable[[], asyncio.Event],
    most_pause: float,
) -> tuple[bool, float]:
    """Until ``look`` (for consumer ``name``, each waiting up to ``timeout``) finds it: whether
    the first look did, and the round trip of the one that did. ``reached()`` is the event a
    forward that reaches the hub sets (and replaces): the uplink carries, look again now."""
    pause, first = FIRST_PAUSE_S, True
    every = min(max(LOOK_S, 2 * min(rtt, MAX_RTT_S)), timeout / 2)
    looks: dict[asyncio.Future[Any], float] = {}
    try:
        while True:
            raise_if_cancelled()
            event = reached()
            if time.monotonic() - max(looks.values(), default=-math.inf) >= LOOK_GAP_S:
                _add(looks, asyncio.ensure_future(look()))
            found, failed = await _look_on(looks, event, every, name)
            if found is not None:
                return first, found
            first = False
            if failed is None:
                continue  # unanswered so far, or outrun by a forward: look again now
            try:
                await asyncio.wait_for(event.wait(), pause)
            except asyncio.TimeoutError:
                pause = min(pause * 2, REFUSED_PAUSE_S if failed == "refused" else most_pause)
            else:
                pause = FIRST_PAUSE_S
    finally:
        for task in looks:
            task.cancel()
        await asyncio.gather(*looks, return_exceptions=True)


def _add(looks: dict[asyncio.Future[Any], float], task: asyncio.Future[Any]) -> None:
    looks[task] = time.monotonic()
    if len(looks) > MAX_LOOKS:  # the first stays: a slow hub's answer still counts
        spare = next((t for t in list(looks)[1:] if not t.done()), None)  # an ended one is read
        if spare is not None:
            del looks[spare]
            spare.cancel()


async def _look_on(
    looks: dict[asyncio.Future[Any], float], reached: asyncio.Event, every: float, name: str
) -> tuple[float | None, str | None]:
    """Wait ``every`` seconds at most for one of ``looks`` (each with when it was sent) to end,
    or for ``reached``: the round trip of the newest that found the consumer, or None, and
    how one failed outright, if one did (``refused``: nobody answered it; ``failed``), those
    that ended leaving ``looks``."""
    outrun = asyncio.ensure_future(reached.wait())
    try:
        await asyncio.wait((*looks, outrun), timeout=every, return_when=asyncio.FIRST_COMPLETED)
    finally:
        outrun.cancel()
    found: float | None = None
    failed: str | None = None
    now = time.monotonic()
    for task in [task for task in looks if task.done()]:
        began = looks.pop(task)
        if (exc := task.exception()) is None:
            found = now - began if found is None else min(found, now - began)
            continue
        if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError)):
            continue  # unanswered: the looks beside it are paced by ``every``, not paused
        if not isinstance(exc, (APIError, nats.errors.Error)):
            raise exc
        log.debug("consumer not there yet", consumer=name, error=repr(exc))
        refused = isinstance(exc, (ServiceUnavailableError, nats.errors.NoRespondersError))
        failed = "refused" if refused and failed != "failed" else "failed"
    return found, None if found is not None else failed
