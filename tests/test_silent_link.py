"""A link to the server that goes silent without a reset (the server's host lost, a partition, a
NAT that dropped the connection): the socket still says connected, so nothing that heals on a
closed connection runs until the client notices by itself. It pings its server every
``ping_interval`` (1 s) and takes the link for dead when three in a row go unanswered; with
nats-py's own defaults (a ping every 2 minutes, two unanswered) it noticed after 6 minutes, and
meanwhile an edge waited out the 5 s JetStream ack of every cloud request while ``/ready`` said
ready. A pause shorter than that (a server stopped for a moment) is not taken for a loss."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.helpers import eventually, holds

NOTICED_WITHIN_S = 8.0
"""Generous beside the 3 to 4 s it takes (printed), far below nats-py's default 360 s."""


@pytest.fixture
async def linked(
    nats_server: NatsServer, settings: MeshSettings
) -> AsyncIterator[tuple[Connection, TcpProxy]]:
    proxy = await TcpProxy(int(nats_server.url.rsplit(":", 1)[1])).start()
    settings.nats.url = proxy.url
    conn = await Connection(settings.nats, "silent-link").connect()
    try:
        yield conn, proxy
    finally:
        await conn.close()
        await proxy.stop()


async def test_a_link_gone_silent_is_noticed_and_dialled_again(
    linked: tuple[Connection, TcpProxy],
) -> None:
    conn, proxy = linked
    await conn.nc.flush(timeout=2)
    proxy.freeze()
    frozen = time.monotonic()
    await eventually(
        lambda: holds(conn.drops == 1), timeout=NOTICED_WITHIN_S, what="the silent link noticed"
    )
    print(f"\nsilent link noticed after {time.monotonic() - frozen:.2f} s")
    assert not conn.connected
    proxy.restore()
    await eventually(lambda: holds(conn.connected), timeout=10, what="the link back")
    assert conn.reconnects == 1
    await conn.nc.flush(timeout=2)  # and it carries traffic again
    info = await conn.jsm().account_info()
    assert info is not None


async def test_a_short_silence_is_not_taken_for_a_loss(
    linked: tuple[Connection, TcpProxy],
) -> None:
    conn, proxy = linked
    await conn.nc.flush(timeout=2)
    proxy.freeze()
    await asyncio.sleep(1.5)  # the fault's length: a server paused for a moment
    proxy.restore()
    await conn.nc.flush(timeout=5)  # the pings held back meanwhile are answered now
    assert conn.drops == 0 and conn.connected
