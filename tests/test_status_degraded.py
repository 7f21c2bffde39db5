"""``mesh status`` when the mesh is not well, which is when an operator runs it: each part that
cannot be read says so and the rest is still shown, and a worker's own word on its health is
printed. Before, a registry that could not be read (an election, JetStream down) ended the
command in one error line; a worker whose announcement failed was shown as a healthy one, and
once its entry aged out of the registry, not at all."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.status import collect_status, render
from protocol.subjects import NODES_STREAM
from tests.conftest import make_settings
from tests.helpers import eventually, holds


async def test_status_without_jetstream_says_what_it_cannot_read(
    server_without_jetstream: NatsServer,
) -> None:
    settings = make_settings(server_without_jetstream.url)
    async with Connection(settings.nats, "status") as conn:
        status = await asyncio.wait_for(collect_status(conn, settings), 30)
    printed = "\n".join(render(status))
    assert status["registry"].startswith("unavailable"), status["registry"]
    assert "registry: unavailable" in printed
    assert "queue: cannot be read" in printed
    assert "answer store: cannot be read" in printed
    assert "edges: 0" in printed


@contextlib.asynccontextmanager
async def _worker_and_operator(
    server: NatsServer,
) -> AsyncIterator[tuple[MeshSettings, Worker, Connection]]:
    settings = make_settings(server.url)
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "operator") as op,
        Worker(settings, wconn, backend) as worker,
    ):
        yield settings, worker, op


async def test_a_worker_s_own_word_on_its_health_is_shown(own_server: NatsServer) -> None:
    async with _worker_and_operator(own_server) as (settings, worker, op):
        config = (await op.jsm().stream_info(NODES_STREAM)).config
        config.sealed = True  # its announcements fail from now on
        await op.jsm().update_stream(config)
        await eventually(lambda: holds(worker.status()["health"] == "unannounced"), 15)
        printed = "\n".join(render(await collect_status(op, settings)))
    row = next(line for line in printed.splitlines() if worker.node_id in line)
    assert "health=unannounced" in row, printed


async def test_a_worker_the_registry_does_not_show_is_listed_all_the_same(
    own_server: NatsServer,
) -> None:
    async with _worker_and_operator(own_server) as (settings, worker, op):
        await worker._heartbeat.stop()  # out of the registry; its STATS still answer
        status = await collect_status(op, settings)
    printed = "\n".join(render(status))
    row = next(line for line in printed.splitlines() if worker.node_id in line)
    assert "NOT IN THE REGISTRY" in row, printed
    assert "workers alive: 0" in printed, printed
