"""Keeping a request the worker is generating: progress reports, and its lease refreshed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cloud_node.lease import OTHER_COPY, Lease, Leases
from mesh.logs import get_logger
from mesh.tasks import TaskSet

log = get_logger(__name__)

Claim = Callable[[int, str], Awaitable[Lease | str | None]]
"""Take the lease again for (queued copy, fingerprint): see :meth:`Leases.claim`."""


async def keep_alive(
    msg: Msg,
    lease: Lease | None,
    *,
    interval: float,
    ack_wait: float,
    leases: Leases,
    claim: Claim,
    generating: asyncio.Task[Any],
    since: float,
) -> None:
    """Progress reports every ``interval``, the first at once (:class:`KeepAlive` starts this
    one interval into the generation). The lease (if any) is refreshed with them, at most every
    ack_wait / 2 (a quarter of its lifetime: one write a second per request would be five
    times as many); ``since`` is the loop time the generation began, a little after the lease
    was taken. A lease lost to another copy (it lapsed while this worker could not reach the
    store) hands this copy back: ``generating`` is cancelled, the other copy is answered, and
    this one is let go."""
    loop = asyncio.get_running_loop()
    refreshed = since
    while True:
        try:
            await msg.in_progress()
        except nats.errors.Error as exc:
            log.warning("in_progress failed", error=repr(exc))
        if lease is not None and loop.time() - refreshed >= ack_wait / 2:
            refreshed = loop.time()
            if not await leases.refresh(lease):
                claimed = await claim(lease.copy, lease.fingerprint)
                if claimed == OTHER_COPY:
                    log.warning("lease lost to another copy; handing this one back")
                    generating.cancel()  # not a client's cancel: the message is handed back
                    return
                lease = claimed if isinstance(claimed, Lease) else None
        await asyncio.sleep(interval)


class KeepAlive:
    """Starts :func:`keep_alive` one ``interval`` into a generation, so that an answer done
    sooner (most short ones) costs a timer, not a task; :meth:`stop` ends either."""

    def __init__(self, tasks: TaskSet, interval: float, **kwargs: Any) -> None:
        loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        since = loop.time()

        def begin() -> None:
            self._task = tasks.spawn(
                keep_alive(interval=interval, since=since, **kwargs), name="in-progress"
            )

        self._timer = loop.call_later(interval, begin)

    def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
