"""A sender counts on JetStream's word only once sure to hear it (:func:`mesh.stream_deleted.hear`).

The server refuses a subscription after taking it, with an error, never as its answer: nats-py
passes it to the error callback. ``hear`` says None when the user's credentials tell the
refusal ahead, or the server says it before answering a flush sent after the subscription.
Permissions in the server's own config (users and passwords) are not in any credentials file:
only the server's word tells them. Before, ``hear`` flushed once, and nats-py had written the
flush's ping ahead of the subscription about one time in ten: the answer came before the
refusal, and a sender counted on a word it would never hear."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.stream_deleted import consumer_deleted, hear
from tests.conftest import make_settings

DENIED = consumer_deleted("MESH_INFER", "*")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    conf = tmp_path / "users.conf"
    conf.write_text(
        "port: -1\n"
        "authorization { users = [\n"
        "  {user: may, password: may}\n"
        '  {user: maynot, password: maynot, permissions: {subscribe: {deny: ["$JS.EVENT.>"]}}}\n'
        "] }\n"
    )
    async with NatsServer(config=str(conf)) as running:
        yield running


async def _word(_msg: Msg) -> None:
    pass


async def test_a_refusal_by_the_servers_own_config_is_heard_every_time(
    server: NatsServer,
) -> None:
    settings = make_settings(server.url)
    settings.nats.user = settings.nats.password = "maynot"
    for _ in range(30):
        async with Connection(settings.nats, "sender") as conn:
            assert conn.claims is None  # nothing to tell it ahead
            assert await hear(conn, DENIED, _word) is None


async def test_a_subscription_the_server_takes_is_heard(server: NatsServer) -> None:
    settings = make_settings(server.url)
    settings.nats.user = settings.nats.password = "may"
    async with Connection(settings.nats, "sender") as conn:
        heard = await hear(conn, DENIED, _word)
        assert heard is not None and heard.subject == DENIED
