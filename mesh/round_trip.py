"""A round trip to the server that is never cut short.

nats-py's flush (and its ``rtt``) with a timeout cancels the future it waits on when the
timeout passes, but leaves it queued for the server's PONG: a PONG that comes later sets a
result on the cancelled future, and the connection stops reading (an ``InvalidStateError`` in
its read loop) until its stale check reconnects. A round trip here is a flush in a task of its
own with a long timeout (a reconnect, which a link that slow gets first, drops its wait
instead); its caller waits for the task as long as it likes, and leaves it running. Never
cancel the task: that cancels the same future, with the same end.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

LONG_S = 30
"""How long the flush itself may wait (seconds)."""


def round_trip(nc: Any, held: set[asyncio.Task[None]]) -> asyncio.Task[None]:
    """A flush of ``nc`` in a task kept in ``held`` until it ends (its error, if any, taken:
    a link that died meanwhile is its caller's to say)."""
    task = asyncio.get_running_loop().create_task(nc.flush(timeout=LONG_S))
    held.add(task)
    task.add_done_callback(functools.partial(_settled, held))
    return task


def _settled(held: set[asyncio.Task[None]], task: asyncio.Task[None]) -> None:
    held.discard(task)
    if not task.cancelled():
        task.exception()
