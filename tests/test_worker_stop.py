"""A worker stopped while its NATS server is gone stops without waiting on that server: no
registry delete, no peers check left to time out. Its answers in flight get their drain grace
(the server may come back within it), not the 5 s of a request nobody can answer. The same when
the server dies as a worker or an edge stops: what the stop asked the server ends when the link
drops (``Connection.while_linked``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cloud_node.delivery import store_look_timeout
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from protocol.messages import TokenEvent
from tests.conftest import make_settings
from tests.helpers import eventually


@pytest.fixture
async def server(own_server: NatsServer) -> NatsServer:
    return own_server


async def _worker(server: NatsServer, grace: float) -> tuple[Worker, Connection]:
    settings = make_settings(server.url, worker__drain_grace=grace)
    assert settings.nats.request_timeout >= 5.0  # what a wait on the gone server would cost
    conn = await Connection(settings.nats, "stopping-worker").connect()
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=50)
    )
    worker = Worker(settings, conn, backend)
    await worker.start()
    return worker, conn


async def _cut_off(server: NatsServer, conn: Connection) -> None:
    await server.kill()  # kill -9, by PID

    async def cut() -> bool:
        return not conn.connected

    await eventually(cut, what="the worker to see its server gone")


async def test_a_worker_with_no_server_left_stops_at_once(server: NatsServer) -> None:
    worker, conn = await _worker(server, grace=5.0)
    try:
        await _cut_off(server, conn)
        began = time.monotonic()
        await asyncio.wait_for(worker.stop(), 10)
        took = time.monotonic() - began
    finally:
        await conn.close()
    assert took < 0.5, f"stopped in {took:.2f}s with nothing in flight"  # was 1 s: the delete


async def test_answers_in_flight_get_their_grace_not_a_wait_on_the_gone_server(
    server: NatsServer,
) -> None:
    grace = 0.5
    worker, conn = await _worker(server, grace=grace)
    # A handler cut short looks in the answer store (bounded) before it leaves the delivery.
    store_wait = store_look_timeout(worker.settings)
    client = MeshClient(settings=make_settings(server.url), first_event_timeout=10)
    await client.start()
    first = asyncio.Event()

    async def ask() -> None:
        async for event in client.stream("[tag:stop] count", via="cloud", max_tokens=400):
            if isinstance(event, TokenEvent):
                first.set()

    asking = asyncio.ensure_future(ask())
    try:
        await asyncio.wait_for(first.wait(), 10)
        assert worker.handler.inflight
        await _cut_off(server, conn)
        began = time.monotonic()
        await asyncio.wait_for(worker.stop(), 20)
        took = time.monotonic() - began
    finally:
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        await client.close()
        await conn.close()
    # The grace, then the look at the store; the peers check used to wait out the 5 s request
    # timeout before either.
    assert took < grace + store_wait + 1.0, f"stopped in {took:.2f}s"


# -- stopped as the server dies: the link drops while the stop asks the server -------------


async def test_a_worker_stopped_as_its_server_dies_stops_at_once(server: NatsServer) -> None:
    worker, conn = await _worker(server, grace=5.0)
    try:
        began = time.monotonic()
        stopping = asyncio.ensure_future(worker.stop())  # connected: it asks the server
        await server.kill()  # kill -9 meanwhile
        await asyncio.wait_for(stopping, 10)
        took = time.monotonic() - began
    finally:
        await conn.close()
    # Was 1.0 s: the registry delete, sent before the link dropped, waited out its interval.
    assert took < 0.5, f"stopped in {took:.2f}s"


async def test_an_edge_stopped_as_its_server_dies_stops_at_once(server: NatsServer) -> None:
    settings = make_settings(server.url)
    settings.edge.model.backend = "deterministic"
    assert settings.nats.request_timeout >= 5.0  # what a wait on the gone server would cost
    conn = await Connection(settings.nats, "stopping-edge").connect()
    edge = EdgeNode(settings, conn, DeterministicBackend(settings.edge.model), HeuristicRouter())
    await edge.start()
    try:
        began = time.monotonic()
        stopping = asyncio.ensure_future(edge.stop())
        await server.kill()
        await asyncio.wait_for(stopping, 10)
        took = time.monotonic() - began
        closing = time.monotonic()
        await conn.close()
        closed = time.monotonic() - closing
    finally:
        await conn.close()
    # Was 5.0 s: the micro service's stop drained its subscriptions, and the drain's flush
    # waited out the request timeout for a server that was gone.
    assert took < 0.5, f"stopped in {took:.2f}s"
    assert closed < 0.5, f"closed in {closed:.2f}s"
