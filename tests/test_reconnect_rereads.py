"""What a connection learnt of its credentials is learnt again at each reconnect, when nats-py
reads the credentials file again: a subscription the server refused (the queue's advisories,
for an app's user) was taken as refused for the process's life, and with it the slower way of
looking (polling the queue) kept, though a rotated file allowed it since."""

from __future__ import annotations

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.conftest import linked_settings
from tests.helpers import eventually, holds


async def test_refusals_are_forgotten_at_a_reconnect(nats_server: NatsServer) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    try:
        settings = linked_settings(proxy.url)
        async with Connection(settings.nats, "rereads") as conn:
            conn.refused_subscriptions.add("$js.event.advisory.consumer.deleted.x.y")
            proxy.cut(0.2)
            await eventually(lambda: holds(conn.reconnects == 1), 10, "the reconnect")
            assert conn.refused_subscriptions == set()  # the server allows it now
    finally:
        await proxy.stop()


async def test_a_listen_refused_before_is_tried_again_after_a_reconnect(
    nats_server: NatsServer,
) -> None:
    """The SDK's look at which models are served listens for pools' consumers deleted; under
    credentials that did not allow it, it looked instead, for the process's life. After a
    reconnect (a rotated file, read again) it listens again."""
    from mesh.served_models import ServedModels

    proxy = await TcpProxy(nats_server.port).start()
    try:
        settings = linked_settings(proxy.url)
        async with Connection(settings.nats, "relistens") as conn:
            conn.claims = {"nats": {"sub": {"deny": ["$JS.EVENT.>"]}}}  # the old file
            served = ServedModels(conn.jsm, settings.stream, hear=conn)
            try:
                await served("m1")
                await eventually(
                    lambda: holds(served._listening is not None and served._listening.done()),
                    what="the first listen, refused",
                )
                assert served._heard is None
                conn.claims = {"nats": {"sub": {"allow": [">"]}}}  # as a rotated file reads
                proxy.cut(0.2)
                await eventually(lambda: holds(conn.reconnects == 1), 10, "the reconnect")
                await served("m2")
                await eventually(lambda: holds(served._heard is not None), 5, "listening now")
            finally:
                await served.close()
    finally:
        await proxy.stop()
