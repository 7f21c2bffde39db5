"""A connection closed while, or just as, its server dies closes at once: nothing more can be
drained or flushed, and waiting on it would hold a node's stop (or a client's exit) for the
drain's timeout (6 s), or for a reconnect attempt (0.5 s). A real nats-server, killed by PID."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from mesh.connection import Connection, _stop_reconnecting
from mesh.nats_server import NatsServer
from tests.conftest import make_settings

CONNECTIONS = 40
APART_S = 0.02
"""The closes spread over 0.8 s: the first before any connection saw its server go, later ones
during the reconnect attempts (every 0.5 s)."""


@pytest.fixture
async def server(own_server: NatsServer) -> NatsServer:
    return own_server


async def test_connections_closed_as_their_server_dies_close_at_once(server: NatsServer) -> None:
    settings = make_settings(server.url)
    assert settings.nats.drain_timeout + 1 >= 5  # what a wait on the gone server would cost
    conns = []
    for i in range(CONNECTIONS):
        conn = await Connection(settings.nats, f"closing-{i}").connect()
        await conn.nc.subscribe(f"close.{i}")  # a subscription for the drain to wait on
        conns.append(conn)
    took: list[float] = []

    async def close(conn: Connection, after: float) -> None:
        await asyncio.sleep(after)
        started = time.monotonic()
        await conn.close()
        took.append(time.monotonic() - started)

    await server.kill()  # kill -9: the first close starts before anyone saw the server go
    await asyncio.gather(*(close(c, i * APART_S) for i, c in enumerate(conns)))
    # Before: the first waited out the drain's timeout (6.0 s), and a close that came during a
    # reconnect attempt waited for it (0.5 s) now and then.
    assert max(took) < 0.3, sorted(took)[-3:]
    assert not any(c.connected for c in conns)


async def test_a_reconnect_attempt_that_loses_a_cancel_is_stopped_all_the_same() -> None:
    # As on Python 3.11, when the cancel lands as the attempt's connect fails: ``wait_for``
    # returns the connect's error instead, and the attempt goes on to its next wait.
    class Client:
        _reconnection_task: asyncio.Task[None] | None = None

    async def attempt() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # the lost cancel
            await asyncio.sleep(10)
        await asyncio.sleep(10)

    client = Client()
    client._reconnection_task = task = asyncio.create_task(attempt())
    await asyncio.sleep(0)
    started = time.monotonic()
    await _stop_reconnecting(client)  # type: ignore[arg-type]
    assert task.done() and time.monotonic() - started < 0.5
