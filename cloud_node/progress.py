"""Keeping a request the worker is generating: progress reports, and its lease refreshed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cloud_node.lease import OTHER_COPY, Lease, Leases
from mesh.logs import get_logger

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
) -> None:
    """Progress reports every ``interval`` while the request generates; the lease (if any) is
    refreshed with them, at most every ack_wait / 2 (a quarter of its lifetime: one write a
    second per request would be five times as many). A lease lost to another copy (it lapsed
    while this worker could not reach the store) hands this copy back: ``generating`` is
    cancelled, the other copy is answered, and this one is let go."""
    loop = asyncio.get_running_loop()
    refreshed = loop.time()
    while True:
        await asyncio.sleep(interval)
        try:
            await msg.in_progress()
        except nats.errors.Error as exc:
            log.warning("in_progress failed", error=repr(exc))
        if lease is None or loop.time() - refreshed < ack_wait / 2:
            continue
        refreshed = loop.time()
        if await leases.refresh(lease):
            continue
        claimed = await claim(lease.copy, lease.fingerprint)
        if claimed == OTHER_COPY:
            log.warning("lease lost to another copy; handing this one back")
            generating.cancel()  # not a client's cancel: the message is handed back
            return
        lease = claimed if isinstance(claimed, Lease) else None
