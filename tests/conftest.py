"""Real parts only: a nats-server per session (free port, temporary store, readiness from its
log), the real SmolLM2-135M GGUF loaded once per session, and per-test workers and edges."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.logs import configure_logging
from mesh.nats_server import NatsServer
from protocol.subjects import NODES_BUCKET

configure_logging(load_settings(environ={}).log.model_copy(update={"level": "warning"}))


@pytest.fixture(autouse=True)
def _loggers_stay_reconfigurable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI caches each logger on first use (faster); a test that runs the CLI in-process
    would freeze the loggers of every test after it, log capture included."""
    import mesh_app.args

    real = mesh_app.args.configure_logging

    def uncached(settings: Any, stream: Any = None, *, cache: bool = False) -> None:
        real(settings, stream)

    monkeypatch.setattr(mesh_app.args, "configure_logging", uncached)


@pytest.fixture(scope="session")
async def nats_server() -> AsyncIterator[NatsServer]:
    server = NatsServer(port=-1, ready_timeout=15)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def server_without_jetstream(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A nats-server with JetStream off: its JetStream API answers 503 (no responders), as a
    server that has just started may."""
    config = tmp_path / "no-jetstream.conf"
    config.write_text("listen: 127.0.0.1:-1\n")
    async with NatsServer(config=str(config), ready_timeout=15) as server:
        yield server


@pytest.fixture
async def own_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    """A nats-server of this test's own, which it may kill (``kill()``: kill -9, by PID)."""
    server = NatsServer(port=-1, store_dir=str(tmp_path / "store"), ready_timeout=15)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def make_settings(nats_url: str, **overrides: object) -> MeshSettings:
    """Settings for one test: strict decoding, short timeouts, a unique edge id."""
    settings = load_settings(
        {
            ("nats", "url"): nats_url,
            ("strict_decode",): True,
            ("edge", "edge_id"): f"t{uuid.uuid4().hex[:10]}",
            ("edge", "cloud_start_timeout"): 5.0,
            ("edge", "cloud_idle_timeout"): 20.0,
            ("worker", "fetch_timeout"): 0.5,
            ("worker", "drain_grace"): 5.0,
            ("edge", "http_port"): -1,
            ("stream", "ack_wait"): 10.0,
        },
        environ={},
    )
    for dotted, value in overrides.items():
        target = settings
        *parents, leaf = dotted.split("__")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)
    return settings


def linked_settings(nats_url: str) -> MeshSettings:
    """:func:`make_settings` for a process whose link a test cuts: it reconnects within a
    tenth of a second."""
    settings = make_settings(nats_url)
    settings.nats.reconnect_wait = 0.1
    return settings


@pytest.fixture
async def settings(nats_server: NatsServer) -> MeshSettings:
    return make_settings(nats_server.url)


@pytest.fixture
async def conn(settings: MeshSettings) -> AsyncIterator[Connection]:
    async with Connection(settings.nats, "test") as connection:
        # Every test starts from an empty queue and registry: drop the stream (and its
        # consumers), and the node registry (a worker an earlier test killed is still "alive"
        # there until its entry expires).
        with contextlib.suppress(NotFoundError):
            await connection.jsm().delete_stream(settings.stream.name)
        with contextlib.suppress(NotFoundError):
            await connection.jsm().delete_stream(f"KV_{NODES_BUCKET}")
        yield connection


@pytest.fixture
async def js_stream(conn: Connection) -> AsyncIterator[tuple[str, str]]:
    """A JetStream stream of the test's own: its name, and the subject prefix it stores
    (``<prefix>.>``)."""
    name = f"T{uuid.uuid4().hex[:10].upper()}"
    subject = f"jstest.{name}"
    await conn.jsm().add_stream(StreamConfig(name=name, subjects=[f"{subject}.>"]))
    try:
        yield name, subject
    finally:
        with contextlib.suppress(NotFoundError):
            await conn.jsm().delete_stream(name)


@pytest.fixture(scope="session")
async def worker_backend() -> AsyncIterator[LlamaCppBackend]:
    backend = LlamaCppBackend(load_settings(environ={}).worker.model)
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture(scope="session")
async def edge_backend() -> AsyncIterator[LlamaCppBackend]:
    backend = LlamaCppBackend(load_settings(environ={}).edge.model)
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture
async def worker(
    settings: MeshSettings, conn: Connection, worker_backend: LlamaCppBackend
) -> AsyncIterator[Worker]:
    async with Worker(settings, conn, worker_backend) as running:
        yield running


@pytest.fixture
async def edge(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> AsyncIterator[EdgeNode]:
    async with EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router)) as node:
        yield node


@pytest.fixture
async def client(settings: MeshSettings, conn: Connection) -> AsyncIterator[MeshClient]:
    async with MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as sdk:
        yield sdk
