"""A cuttable link for fault tests: a loopback TCP relay in front of nats-server.

``cut(seconds)`` drops every connection through it and refuses new ones for that long;
``restore()`` ends a cut early. ``swallow()`` makes the link half-dead: what clients send is
read and thrown away (a route that lost its way), while the server's side still comes through;
the next cut ends it. ``lose(marker, seconds)`` throws away the next piece the server sends that
holds ``marker`` (a delivery in flight when the link went) and cuts the link with it.
``freeze()`` makes it silent both ways with every socket left open (a host lost without a reset,
a partition, a NAT that dropped the connection): nothing comes through until ``restore()``.
``delay_down`` holds what the server sends that many seconds (a slow return path).
``say_and_close(line)`` sends every client a line as from the server, then closes its link (the
server ending a connection: an expired JWT's ``-ERR``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._clients: set[asyncio.StreamWriter] = set()
        self._cut_until = 0.0
        self._swallowing = False
        self._frozen = False
        self.swallowed = bytearray()
        """What the link threw away (see :meth:`swallow`)."""
        self.delay_down = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._lose: tuple[bytes, float] | None = None
        self.lost = 0
        """Pieces thrown away by :meth:`lose`."""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._drop()
        for task in list(self._tasks):
            task.cancel()

    def cut(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones for ``seconds``."""
        self._cut_until = time.monotonic() + seconds
        self._swallowing = False
        self._drop()

    def swallow(self) -> None:
        """From now until the next cut, throw away what clients send (the writes of every
        connection through the link vanish, unseen by either side)."""
        self._swallowing = True

    def lose(self, marker: bytes, seconds: float) -> None:
        """Throw away the next piece the server sends that holds ``marker``, unseen by the
        client, and cut the link for ``seconds`` with it: what was in flight when a link went."""
        self._lose = (marker, seconds)

    def freeze(self) -> None:
        """Throw away what either side sends, on every connection through the link, old and
        new, until :meth:`restore`: no socket closes, so neither side hears of it."""
        self._frozen = True

    def restore(self) -> None:
        """End a cut or a freeze now: what is sent, and new connections, go through again."""
        self._cut_until = 0.0
        self._frozen = False

    def say_and_close(self, line: bytes = b"-ERR 'User Authentication Expired'\r\n") -> None:
        """Send every client ``line`` as from the server, then close each link."""
        for writer in list(self._clients):  # each link's pumps end with it (not aborted
            with contextlib.suppress(Exception):  # here: that would throw the line away)
                writer.write(line)
                writer.transport.close()  # after what it holds: the line goes out first

    def _drop(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._cut_until:
            writer.transport.abort()
            return
        self._writers.add(writer)  # a cut while the upstream side is being dialled drops it too
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            return
        if writer not in self._writers:  # dropped meanwhile (a cut, a stop): so is its upstream
            up_writer.transport.abort()
            return
        self._writers.add(up_writer)
        self._clients.add(writer)
        for src, dst, upward in ((reader, up_writer, True), (up_reader, writer, False)):
            pump = self._pump(src, dst, upward, writer, up_writer)
            task = asyncio.get_running_loop().create_task(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        upward: bool,
        *pair: asyncio.StreamWriter,
    ) -> None:
        try:
            while data := await src.read(65536):
                if self._frozen:
                    continue
                if upward and self._swallowing:
                    self.swallowed += data
                    continue
                if not upward and self._lose is not None and self._lose[0] in data:
                    self.lost += 1
                    self.cut(self._lose[1])
                    self._lose = None
                    return
                if not upward and self.delay_down > 0:  # in order: the same delay for each
                    asyncio.get_running_loop().call_later(self.delay_down, _write, dst, data)
                    continue
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for writer in pair:
                with contextlib.suppress(Exception):
                    writer.transport.abort()
                self._writers.discard(writer)
                self._clients.discard(writer)


def _write(dst: asyncio.StreamWriter, data: bytes) -> None:
    if not dst.is_closing():
        dst.write(data)
