"""mesh.backends.eager_send: a request to the engine leaves while the worker's loop is busy with
other requests, and the coroutine it starts early behaves as it would in its own task."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import aiohttp
import pytest

from mesh.backends.eager_send import EagerRequest
from mesh.eager import start_now


class _OneShotHttp:
    """A plain-socket HTTP server in a thread: notes when each request's bytes arrived (the
    event loop under test cannot delay it) and answers ``{}``."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.arrived: list[float] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._keep_alive, args=(conn,), daemon=True).start()

    def _keep_alive(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in data:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    data += piece
                head, _, data = data.partition(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                while len(data) < length:
                    data += conn.recv(65536)
                data = data[length:]
                self.arrived.append(time.monotonic())
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 2\r\n\r\n{}"
                )

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def http_server() -> Iterator[_OneShotHttp]:
    server = _OneShotHttp()
    yield server
    server.close()


async def _arrival_vs_busy_loop(server: _OneShotHttp, request_class: type) -> tuple[float, float]:
    """POST, on a kept-alive connection, while another callback is queued that holds the loop
    for 0.3 s (another request's handler, in a burst). Returns when the request arrived and when
    the loop was free again."""
    freed: list[float] = []

    def busy() -> None:
        time.sleep(0.3)
        freed.append(time.monotonic())

    url = f"http://127.0.0.1:{server.port}/"
    async with aiohttp.ClientSession(request_class=request_class) as session:
        async with session.post(url, json={"n": 0}) as resp:  # the connection, kept alive
            assert await resp.json() == {}
        asyncio.get_running_loop().call_soon(busy)
        async with session.post(url, json={"n": 1}) as resp:
            assert await resp.json() == {}
    return server.arrived[1], freed[0]


async def test_a_post_reaches_the_server_while_the_loop_is_busy(http_server: _OneShotHttp) -> None:
    arrived, freed = await _arrival_vs_busy_loop(http_server, EagerRequest)
    assert arrived < freed, "the request waited for the busy loop before it was written"


async def test_start_now_returns_what_a_coroutine_without_waits_returns() -> None:
    ran: list[str] = []

    async def quick() -> int:
        ran.append("now")
        return 7

    rest = start_now(quick())
    assert ran == ["now"]  # ran in the call, before any task
    assert await asyncio.create_task(rest) == 7


async def test_start_now_goes_on_after_a_wait_with_what_the_wait_gave() -> None:
    steps: list[str] = []
    gate: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def waits() -> str:
        steps.append("before")
        got = await gate
        steps.append(f"after {got}")
        return got.upper()

    task = asyncio.create_task(start_now(waits()))
    assert steps == ["before"]
    gate.set_result("ok")
    assert await asyncio.wait_for(task, 5) == "OK"
    assert steps == ["before", "after ok"]


async def test_start_now_raises_in_the_task_what_the_coroutine_raised() -> None:
    async def fails_at_once() -> None:
        raise ValueError("at once")

    async def fails_later() -> None:
        await asyncio.sleep(0)
        raise KeyError("later")

    rest = start_now(fails_at_once())  # not raised here: where the task would have raised it
    with pytest.raises(ValueError, match="at once"):
        await asyncio.create_task(rest)
    with pytest.raises(KeyError, match="later"):
        await asyncio.create_task(start_now(fails_later()))


async def test_cancelling_the_task_cancels_the_started_coroutine() -> None:
    cleaned: list[str] = []

    async def long() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("finally")

    task = asyncio.create_task(start_now(long()))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["finally"]
