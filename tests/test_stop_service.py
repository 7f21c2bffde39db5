"""A node's shutdown is bounded: stopping its NATS micro service cannot hang it.

nats-py's ``Service.stop`` drains each subscription, and a drain waits for the messages queued
for the subscription's handler with no limit of its own; a subscription whose message task
ended with a message still queued (a cancelled handler) holds it for ever. Real nats-server.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats import micro
from nats.aio.msg import Msg

from mesh.connection import Connection, stop_service


async def _stuck_service(conn: Connection) -> micro.Service:
    """A service one of whose subscriptions holds a message its task will never take."""
    service = await micro.add_service(conn.nc, name="stuck", version="0.0.1")
    sub = next(iter(service._subscriptions.values()))
    sub._stop_processing()  # the message task ends, as when a handler was cancelled
    await asyncio.sleep(0)
    sub._pending_queue.put_nowait(Msg(conn.nc, subject="x", data=b""))
    return service


async def test_a_service_whose_drain_never_ends_holds_nothing_up(conn: Connection) -> None:
    premise = await _stuck_service(conn)
    with pytest.raises(asyncio.TimeoutError):  # nats-py alone: the stop never ends
        await asyncio.wait_for(premise.stop(), 1.0)

    service = await _stuck_service(conn)
    began = time.monotonic()
    await stop_service(conn, service, 0.5)
    assert time.monotonic() - began < 2.0


async def test_a_service_stops_as_usual_and_none_is_nothing(conn: Connection) -> None:
    service = await micro.add_service(conn.nc, name="fine", version="0.0.1")
    await stop_service(conn, service, 5.0)
    assert service.stopped.is_set()
    await stop_service(conn, None, 5.0)
