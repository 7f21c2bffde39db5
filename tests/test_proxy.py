"""The fault tests' cuttable link (``mesh.testing.proxy``): a cut drops every connection through
it, including one whose other side it was still dialling when the cut came. Before, such a
connection was kept once the dial finished, and outlived a cut meant to last an hour (a leaf's
redial that raced the cut in ``test_compose_nats``: its link never dropped)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mesh.testing.proxy import TcpProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _carries(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Whether the connection carries a message there and back (False: closed or reset)."""
    try:
        writer.write(b"ping")
        await writer.drain()
        return await asyncio.wait_for(reader.read(4), 5) == b"ping"
    except (ConnectionError, OSError):
        return False
    finally:
        writer.transport.abort()


async def _echoes(port: int) -> bool:
    """Whether a new connection through ``port`` carries a message there and back."""
    return await _carries(*await asyncio.open_connection("127.0.0.1", port))


async def test_a_cut_drops_a_connection_still_being_dialled(
    echo_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = await TcpProxy(echo_port).start()
    dial = asyncio.open_connection
    dialling, go_on = asyncio.Event(), asyncio.Event()

    async def held_dial(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if port == echo_port:  # the proxy's own dial upstream: held until the cut came
            dialling.set()
            await go_on.wait()
        return await dial(host, port)

    try:
        assert await _echoes(proxy.port)  # the link works before any cut
        monkeypatch.setattr(asyncio, "open_connection", held_dial)
        reader, writer = await dial("127.0.0.1", proxy.port)
        await asyncio.wait_for(dialling.wait(), 5)
        proxy.cut(3600)
        go_on.set()
        assert not await _carries(reader, writer)  # dropped once its dial ended
        monkeypatch.setattr(asyncio, "open_connection", dial)
        assert not await _echoes(proxy.port)  # the cut goes on
        proxy.restore()
        assert await _echoes(proxy.port)  # and ends when restored
    finally:
        await proxy.stop()
