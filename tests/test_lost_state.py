"""JetStream state lost under a node whose own link stays up (an operator's ``nats consumer rm``,
a hub server that lost a stream its node is not connected to): the node hears it from the server
(a pull request ended with "409 Consumer Deleted", then "503 no responders") and puts the state
back at once, named as restoring meanwhile. Before, only a reconnect of its own link rebuilt it:
a worker whose consumer was deleted pulled nothing, said "ok", and every request for its model
waited in the queue until the worker was restarted."""

from __future__ import annotations

import time

import pytest
from nats.js.errors import NotFoundError

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from tests.conftest import make_settings
from tests.helpers import eventually


async def _consumer_exists(conn: Connection, stream: str, consumer: str) -> bool:
    try:
        await conn.jsm().consumer_info(stream, consumer)
    except NotFoundError:
        return False
    return True


@pytest.mark.parametrize("what", ["consumer", "stream"])
async def test_a_worker_puts_back_its_queue_deleted_under_it(
    own_server: NatsServer, what: str
) -> None:
    settings = make_settings(own_server.url)
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "operator") as op,
        Worker(settings, wconn, backend) as worker,
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        stream, consumer = worker._stream.name, worker.consumer
        first = await client.complete("before", via="cloud", max_tokens=4)
        assert first.text
        if what == "consumer":
            await op.jsm().delete_consumer(stream, consumer)
        else:
            await op.jsm().delete_stream(stream)
        lost = time.monotonic()
        await eventually(
            lambda: _consumer_exists(op, stream, consumer),
            timeout=10,
            what=f"the worker to put back its {what}",
        )
        back = time.monotonic() - lost
        await eventually(lambda: _is(worker.status()["health"] == "ok"), what="health ok again")
        answer = await client.complete("after", via="cloud", max_tokens=4)
        assert answer.text and answer.end.served_by == f"cloud:{worker.node_id}"
        print(f"\n{what} deleted: back after {back:.3f} s")
        assert back < 3.0, back  # a pull request's end says so at once; no reconnect needed


async def _is(value: bool) -> bool:
    return value
