"""Keeping a request the worker is generating: progress reports, and (for a request that can
wait) its lease renewed with them.

A worker that stood still (its process paused, its event loop stalled) or lost its link for
most of ``ack_wait`` may no longer hold its delivery: JetStream may have given the request to
another worker, which continues the answer as a newer attempt. Acks, naks and terms name the
message, not the delivery, so a stale one would let go of the other worker's delivery too (an
ack deletes the request while that worker still answers it). :class:`KeepAlive` notices such a
lapse; from then on this worker does not settle the message (the holder of the newest delivery,
or a redelivery that finds the outcome stored, does), and once the answer store shows a newer
attempt it stops generating.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from mesh.logs import get_logger
from mesh.tasks import TaskSet, raise_if_cancelled
from protocol.errors import MeshError

log = get_logger(__name__)

Renew = Callable[[], Awaitable[bool]]
"""Renews what a request holds besides its delivery (a lease: :class:`cloud_node.lease.Holding`);
False when it was lost to another copy of the request, which is then answered instead."""
LAPSE_FRACTION = 0.8
"""A gap of ack_wait x this since the delivery or the last progress report counts as a lapse:
JetStream may have redelivered the request (reports normally come every ack_wait x 0.2)."""


async def keep_alive(
    msg: Msg,
    renew: Renew | None,
    *,
    interval: float,
    ack_wait: float,
    generating: asyncio.Task[Any],
    since: float,
    keeper: KeepAlive,
) -> None:
    """Progress reports every ``interval``, the first at once (:class:`KeepAlive` starts this
    one interval into the generation). ``renew`` (a request that can wait: its lease) is called
    with them, at most every ack_wait / 2 (a quarter of a lease's lifetime: one write a second
    per request would be five times as many); ``since`` is the loop time the generation began,
    a little after the lease was taken. A lease lost to another copy (it lapsed while this
    worker could not reach the store) hands this copy back: ``generating`` is cancelled, the
    other copy is answered, and this one is let go. After a lapse (see :class:`KeepAlive`), a
    newer attempt in the answer store stops this one: ``generating`` is cancelled and the
    message left to its holder."""
    loop = asyncio.get_running_loop()
    refreshed = since
    while True:
        raise_if_cancelled()  # one in_progress's or renew's wait_for swallowed (Python 3.11)
        if (keeper.lapsed() or keeper.interrupted()) and await keeper.stop_if_superseded():
            return
        try:
            await msg.in_progress()
            if keeper.connected():  # else nats-py only buffered it: JetStream has not heard
                keeper.reported = loop.time()
        except nats.errors.Error as exc:
            log.warning("in_progress failed", error=repr(exc))
        if renew is not None and loop.time() - refreshed >= ack_wait / 2:
            refreshed = loop.time()
            if not await renew():
                generating.cancel()  # not a client's cancel: the message is handed back
                return
        await asyncio.sleep(interval)


class KeepAlive:
    """Starts :func:`keep_alive` one ``interval`` into a generation, so that an answer done
    sooner (most short ones) costs a timer, not a task; :meth:`stop` ends either.

    ``received``: the loop time the delivery arrived. ``newer_attempt``: whether the answer
    store holds an attempt newer than this one (read only after a lapse). ``connected``:
    whether the worker's connection is up; a report made while it is down does not count (a
    link down that long is a lapse too). ``interrupted``: whether the connection dropped or the
    process stood still since the delivery (then the store decides, see :meth:`taken_over`).
    ``renew``: what else the request holds, renewed with the reports (see :func:`keep_alive`)."""

    def __init__(
        self,
        tasks: TaskSet,
        interval: float,
        *,
        received: float,
        newer_attempt: Callable[[], Awaitable[bool]],
        connected: Callable[[], bool],
        interrupted: Callable[[], bool] = lambda: False,
        msg: Msg,
        ack_wait: float,
        generating: asyncio.Task[Any],
        renew: Renew | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        since = loop.time()
        self.reported = received
        """Loop time of the last progress report (at first: the delivery's arrival)."""
        self._limit = ack_wait * LAPSE_FRACTION
        self._lapsed = False
        self._newer_attempt = newer_attempt
        self.connected = connected
        self.interrupted = interrupted
        """Whether the connection dropped or the process stood still since the delivery: a live
        worker may have handed the delivery back meanwhile (:mod:`cloud_node.orphans`)."""
        self.stopped = False
        """Generation was stopped: a newer attempt took the request over."""
        self._generating = generating
        self._tasks = tasks

        def begin() -> None:
            self._task = tasks.spawn(
                keep_alive(
                    msg,
                    renew,
                    interval=interval,
                    ack_wait=ack_wait,
                    generating=generating,
                    since=since,
                    keeper=self,
                ),
                name="in-progress",
            )

        self._timer = loop.call_later(interval, begin)

    def lapsed(self) -> bool:
        """Whether this worker went ack_wait x LAPSE_FRACTION without reporting progress: its
        delivery may be another worker's by now, so it must not ack, nak or term the message."""
        if not self._lapsed and asyncio.get_running_loop().time() - self.reported >= self._limit:
            self._lapsed = True
            log.warning("progress reports lapsed; the request may have been redelivered")
        return self._lapsed

    def recheck(self) -> None:
        """Now, not at the next progress report: the connection came back or the process
        stood still, so another worker may hold the request; if the store shows it does, stop
        generating (its readers follow the newer attempt and drop this one's events)."""
        self._tasks.spawn(self.stop_if_superseded(), name="recheck")

    async def stop_if_superseded(self) -> bool:
        """Stop generating when the store shows a newer attempt; whether it did."""
        if self.stopped or self._generating.done() or not await self.superseded():
            return self.stopped
        log.warning("another worker took the request over while this one was cut off or still")
        self.stopped = True
        self._generating.cancel()  # neither acked nor handed back: the delivery is not ours
        return True

    async def taken_over(self) -> bool:
        """Whether the delivery may be another worker's: it lapsed, or it was interrupted and
        the answer store shows a newer attempt (or cannot be read). Asked before settling."""
        if self.lapsed():
            return True
        if not self.interrupted():
            return False
        try:
            newer = await self._newer_attempt()
        except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("cannot tell whether the request was handed back", error=repr(exc))
            return True
        if newer:
            log.warning("the request was handed back while this worker was cut off or stood still")
        return newer

    async def superseded(self) -> bool:
        """After a lapse: whether the answer store holds a newer attempt (False if unreadable)."""
        try:
            return await self._newer_attempt()
        except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("cannot tell whether the request was taken over", error=repr(exc))
            return False

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


class LoopStalls:
    """Counts the times this process stood still (SIGSTOP, a starved or blocked event loop) for
    ``STALL_S`` or more: the gaps between the ticks of the process's loop ticker
    (:class:`mesh.loop_lag.LoopLag`, every 50 ms), handed to :meth:`tick`.

    A live worker hands back the delivery of a worker that does not answer "are you there?"
    within :data:`cloud_node.orphans.ALIVE_WAIT_S` (0.4 s): only a process that stood still at
    least that long can have lost a delivery so, and this counts every such stand-still
    (0.3 s), the one still under way included, so the worker checks the answer store before it
    settles anything."""

    STALL_S = 0.3

    def __init__(self, on_stall: Callable[[], None] = lambda: None) -> None:
        self.stalls = 0
        self._last: float | None = None
        self._on_stall = on_stall

    def count(self) -> int:
        """Stand-stills so far, counting one under way (the ticker is late by ``STALL_S``)."""
        if self._last is None:
            return self.stalls
        late = asyncio.get_running_loop().time() - self._last >= self.STALL_S
        return self.stalls + (1 if late else 0)

    def tick(self, now: float) -> None:
        """One tick of the ticker, at ``now`` (``loop.time()``)."""
        last, self._last = self._last, now
        if last is not None and now - last >= self.STALL_S:
            self.stalls += 1
            log.warning("this process stood still", seconds=round(now - last, 2))
            self._on_stall()
