"""A site loop (the forwarder, the collector: ``edge_node.site_links``) that is cancelled while
its fetch returns: on Python 3.11 ``asyncio.wait_for`` may swallow a cancel that comes in the
same loop turn as what it waited on, and the fetch then returns deliveries to a loop that was
asked to stop. The loop must still stop, and hand those deliveries back at once rather than
leave them to the consumer's 30 s ack wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg
from nats.js import api

from edge_node.site_links import SiteLinks, SiteParts
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.pull import Pull
from tests.conftest import make_settings

STREAM, CONSUMER = "SITELOOPTEST", "c"


@pytest.fixture
async def conn(nats_server: NatsServer) -> AsyncIterator[Connection]:
    async with Connection(make_settings(nats_server.url).nats, "site-loop") as c:
        jsm = c.jsm()
        await jsm.add_stream(api.StreamConfig(name=STREAM, subjects=["slt.>"]))
        await jsm.add_consumer(
            STREAM,
            api.ConsumerConfig(
                durable_name=CONSUMER, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=30
            ),
        )
        try:
            yield c
        finally:
            await jsm.delete_stream(STREAM)  # the server is the session's


async def test_a_cancel_the_fetch_swallowed_stops_the_loop_and_hands_back_what_it_brought(
    conn: Connection, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(nats_server.url)
    links = SiteLinks(
        SiteParts(
            conn=conn,
            edge_id="e1",
            scope="e1",
            creds_file=None,
            edge=settings.edge,
            stream=settings.stream,
            models=None,  # type: ignore[arg-type] # the collector's loop does not ask
        )
    )
    fetch, swallowed = Pull.fetch, []

    async def fetch_and_swallow(self: Pull, batch: int, timeout: float) -> list[Msg]:
        msgs = await fetch(self, batch, timeout)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # the loop is asked to stop as the fetch returns...
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:  # ...and the cancel is swallowed, as wait_for may
            swallowed.append(len(msgs))
        return msgs

    monkeypatch.setattr(Pull, "fetch", fetch_and_swallow)
    handled: list[bytes] = []

    async def handle(msg: Msg) -> None:
        handled.append(msg.data)
        await msg.ack()

    await conn.js.publish("slt.a", b"held")
    consumer = (conn.jsm(), "$JS.API", STREAM, CONSUMER)
    loop = asyncio.ensure_future(links._pulled("collect", consumer, 5.0, handle, 1))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(loop, 10)
    await links.stop()
    monkeypatch.undo()
    assert swallowed == [1], swallowed  # the fetch brought the delivery
    assert handled == []  # the loop stopped as asked, before handling it
    again = Pull(conn, STREAM, CONSUMER, prefix="$JS.API", heartbeat=0.5)
    await again.start()
    try:  # handed back: here now, not after the 30 s ack wait
        got = await asyncio.wait_for(again.fetch(1, 30), 3)
    finally:
        await again.stop()
    assert [m.data for m in got] == [b"held"]
    assert got[0].metadata.num_delivered == 2
