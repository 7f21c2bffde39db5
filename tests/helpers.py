"""Small helpers shared by the integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import nats.errors
from aiohttp import web

from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.subjects import consumer_name


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``check`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


async def holds(value: bool) -> bool:
    """``value``, as a check :func:`eventually` can await: ``eventually(lambda: holds(x > 1))``."""
    return value


async def tasks_now(conn: Connection) -> set[asyncio.Task[Any]]:
    """The tasks running now, for :func:`still_running` to compare with later. nats-py answers
    every request of a connection through one subscription (a task), started by its first
    request: started here, it is not taken for something left behind."""
    with contextlib.suppress(nats.errors.NoRespondersError):
        await conn.nc.request(f"nobody.{id(conn)}", b"", timeout=5)
    return set(asyncio.all_tasks())


def still_running(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """The tasks started since ``before`` (:func:`tasks_now`) that still run, the caller's own
    excepted."""
    return {t for t in asyncio.all_tasks() - before if not t.done()} - {asyncio.current_task()}


async def queue_state(
    conn: Connection, settings: MeshSettings, model: str = "smollm2"
) -> dict[str, int]:
    """Messages left in the stream, and the consumer's pending/unacked counts."""
    jsm = conn.jsm()
    stream = await jsm.stream_info(settings.stream.name)
    consumer = await jsm.consumer_info(settings.stream.name, consumer_name(model))
    return {
        "messages": stream.state.messages,
        "num_pending": consumer.num_pending or 0,
        "num_ack_pending": consumer.num_ack_pending or 0,
    }


async def queue_drained(conn: Connection, settings: MeshSettings, model: str = "smollm2") -> bool:
    state = await queue_state(conn, settings, model)
    return state == {"messages": 0, "num_pending": 0, "num_ack_pending": 0}


async def stat_reaches(stats: object, name: str, value: int, timeout: float = 10.0) -> None:
    """Wait until a worker's counter reaches ``value`` (it counts after the ack, which is after
    the client already has the end message)."""

    async def check() -> bool:
        return bool(getattr(stats, name) == value)

    await eventually(check, timeout, what=f"{name} == {value} (now {getattr(stats, name)})")


def modules_loaded_by(code: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running ``code`` (sorted), run from the
    checkout as an application would: what an import pulls in, beyond what it names."""
    root = Path(__file__).resolve().parent.parent
    listed = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )
    loaded: list[str] = json.loads(listed.stdout.strip().splitlines()[-1])
    return loaded


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``scripts/<name>`` run with ``args`` by this interpreter, its output captured (a
    development tool's test checks its exit code, its printout and the figures it wrote)."""
    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, str(root / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def check_side_beside_floor(
    run: subprocess.CompletedProcess[str], out: Path, key: str, side: str, floor: str, rounds: int
) -> None:
    """What a side-beside-its-floor tool (``scripts/chain_bench.py``, ``request_bench.py``)
    must show: it exited cleanly (each side checks its answers came whole), wrote ``rounds``
    positive figures under ``key`` for both sides, the ratio of their best, and printed it."""
    assert run.returncode == 0, run.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures[key]) == {side, floor}
    assert all(len(v) == rounds and min(v) > 0 for v in figures[key].values())
    assert figures["of_floor"] == figures["best"][side] / figures["best"][floor]
    assert f"{side} / {floor}" in run.stdout


def chat_backend(model: str, base: str) -> OpenAIHTTPBackend:
    """The HTTP backend of a 1-slot worker serving ``model`` from the engine at ``base`` (a
    :func:`chat_server`), with continuation off and a 5 s timeout; not started."""
    return OpenAIHTTPBackend(
        ModelSettings(
            backend="openai",
            name=model,
            base_url=base,
            continuation="off",
            slots=1,
            http_timeout=5,
        )
    )


@contextlib.asynccontextmanager
async def chat_server(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A real aiohttp server on a free loopback port that answers ``POST
    /v1/chat/completions`` with ``handler``; yields its base URL (``.../v1``)."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


class ThreadWatcher:
    """A NATS subscriber on a plain socket in a thread, speaking the protocol itself: notes the
    subject of each message and when it arrived, on a clock the event loop under test cannot
    hold up (a test holds that loop with blocking callbacks; the thread runs meanwhile)."""

    def __init__(self, url: str, *subjects: str) -> None:
        parsed = urlparse(url)
        if parsed.port is None:
            raise ValueError(f"{url!r} names no port")
        self.sock = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
        self.file = self.sock.makefile("rb")
        self.file.readline()  # INFO
        subs = "".join(f"SUB {s} {i}\r\n" for i, s in enumerate(subjects, 1))
        self.sock.sendall(f'CONNECT {{"headers":true}}\r\n{subs}PING\r\n'.encode())
        while self.file.readline().strip() != b"PONG":  # subscribed at the server
            pass
        self.seen: list[tuple[str, float]] = []
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def arrived(self) -> list[float]:
        return [at for _, at in self.seen]

    def clear(self) -> None:
        self.seen.clear()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while line := self.file.readline():
                if line.startswith((b"MSG ", b"HMSG ")):
                    self.seen.append((line.split()[1].decode(), time.monotonic()))
                    self.file.read(int(line.split()[-1]) + 2)  # the payload and its CRLF
                elif line.startswith(b"PING"):
                    self.sock.sendall(b"PONG\r\n")

    def close(self) -> None:
        self.sock.close()


async def scrape(url: str) -> str:
    """A metrics page (or any page) that must answer 200."""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200, url
        return await resp.text()


def serving(
    via: str, settings: MeshSettings, conn: Connection, engine: Any
) -> tuple[Any, dict[str, Any]]:
    """The node a stream ``via`` the edge or the cloud is answered by (an edge answering with
    its own model, or a worker), on ``engine``, and the stream's keywords for it."""
    from cloud_node.worker import Worker
    from edge_node.node import EdgeNode
    from edge_node.router import HeuristicRouter

    if via == "edge":
        return EdgeNode(settings, conn, engine, HeuristicRouter()), {"route": "local"}
    return Worker(settings, conn, engine), {}
