"""``Connection.hub_answers`` on an edge site's leaf: the readers that heard "no responders" at
once (every answer an edge relays, as its uplink drops) wait on one look at the hub, not one
each. Real nats-server; a responder stands in for the hub's JetStream API."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from tests.conftest import make_settings
from tests.helpers import eventually, holds

READERS = 50


async def test_readers_asking_at_once_share_one_look_at_the_hub(nats_server: NatsServer) -> None:
    settings = make_settings(nats_server.url)
    settings.nats.hub_domain = "hub"
    asked = 0
    answer_now = asyncio.Event()

    async def hub(msg: Msg) -> None:
        nonlocal asked
        asked += 1
        await answer_now.wait()
        await msg.respond(b"{}")

    async with (
        Connection(settings.nats, "edge") as conn,
        Connection(make_settings(nats_server.url).nats, "hub") as hub_conn,
    ):
        await hub_conn.nc.subscribe("$JS.hub.API.STREAM.INFO.>", cb=hub)
        await hub_conn.subscribed()  # the edge's first ask finds it
        looks = [asyncio.ensure_future(conn.hub_answers(5.0)) for _ in range(READERS)]
        await eventually(lambda: holds(asked >= 1), what="the hub asked")
        looks[0].cancel()  # one reader gives up: the others' look goes on
        answer_now.set()
        answers = await asyncio.gather(*looks[1:])
        assert all(answers)
        assert asked == 1, asked  # before: one look per reader
