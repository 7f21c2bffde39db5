"""A loop's pull consumer (:mod:`mesh.pull`) against a real nats-server: messages handed over as
they come, and a pull request that is over (its consumer deleted, nobody serving it, its
heartbeats gone silent, its link dropped) heard at once, not after the pull's timeout as
nats-py's ``fetch`` does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.js import api

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.pull import RESET_TRIES, Pull, PullLost, Refused
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings
from tests.helpers import eventually, holds

STREAM, CONSUMER = "PULLTEST", "c"
LONG_PULL_S = 30.0
"""A pull far longer than any wait below: whatever ends one sooner is what is tested."""


async def _stream(conn: Connection, **consumer: object) -> None:
    jsm = conn.jsm()
    await jsm.add_stream(api.StreamConfig(name=STREAM, subjects=["pt.>"]))
    await jsm.add_consumer(
        STREAM,
        api.ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=30,
            **consumer,  # type: ignore[arg-type]
        ),
    )


@pytest.fixture
async def conn(nats_server: NatsServer) -> AsyncIterator[Connection]:
    async with Connection(make_settings(nats_server.url).nats, "puller") as c:
        await _stream(c)
        try:
            yield c
        finally:
            await c.jsm().delete_stream(STREAM)  # the server is the session's


async def _pull(conn: Connection, *, prefix: str = "$JS.API", hb: float = 0.2) -> Pull:
    pull = Pull(conn, STREAM, CONSUMER, prefix=prefix, heartbeat=hb)
    await pull.start()
    return pull


async def test_a_fetch_hands_over_a_message_as_it_comes_not_a_full_batch(
    conn: Connection,
) -> None:
    pull = await _pull(conn)
    try:
        waiting = asyncio.create_task(pull.fetch(16, LONG_PULL_S))
        await asyncio.sleep(0.3)  # the pull request is at the server, waiting
        assert not waiting.done()
        await conn.js.publish("pt.a", b"one")
        got = await asyncio.wait_for(waiting, 5)
        assert [m.data for m in got] == [b"one"]
        await got[0].ack()
        await conn.js.publish("pt.b", b"two")  # the same request, still open, brings it
        got = await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
        assert [m.data for m in got] == [b"two"]
    finally:
        await pull.stop()


async def test_a_consumer_deleted_under_a_waiting_fetch_ends_it_at_once(
    conn: Connection,
) -> None:
    pull = await _pull(conn)
    try:
        waiting = asyncio.create_task(pull.fetch(16, LONG_PULL_S))
        await asyncio.sleep(0.3)
        began = time.monotonic()
        await conn.jsm().delete_consumer(STREAM, CONSUMER)
        with pytest.raises(PullLost, match="409"):
            await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - began < 2 * 0.2  # the 409, not a missed heartbeat
        with pytest.raises(PullLost, match="503"):  # asked again: nobody serves it
            await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
    finally:
        await pull.stop()


async def test_a_pull_nobody_answers_is_lost_after_two_heartbeats(conn: Connection) -> None:
    """A consumer missing behind a leaf node's domain gets no 503: the leaf forwards the pull
    to the hub, where nobody takes it. Here something takes pulls and never answers them."""
    async with Connection(conn.settings, "black hole") as hole:
        await hole.nc.subscribe("silence.API.>")
        await hole.subscribed()  # the first pull finds it
        pull = await _pull(conn, prefix="silence.API", hb=0.2)
        try:
            began = time.monotonic()
            with pytest.raises(PullLost, match="no heartbeat"):
                await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
            assert time.monotonic() - began < 2.0
        finally:
            await pull.stop()


async def test_the_first_heartbeat_is_waited_for_a_round_trip_longer(conn: Connection) -> None:
    """Over a slow uplink the first heartbeat comes a round trip after the request: a pull
    whose caller measured 1 s of round trip is not given up before that."""
    async with Connection(conn.settings, "black hole") as hole:
        await hole.nc.subscribe("silence.API.>")
        await hole.subscribed()  # the first pull finds it
        pull = await _pull(conn, prefix="silence.API", hb=0.2)
        pull.rtt = 1.0
        try:
            began = time.monotonic()
            with pytest.raises(PullLost, match="no heartbeat"):
                await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
            assert time.monotonic() - began >= 1.0 + 2 * 0.2
        finally:
            await pull.stop()


async def test_a_pull_the_server_refuses_raises_rather_than_asking_again_at_once(
    nats_server: NatsServer,
) -> None:
    """A push consumer under the name refuses every pull (409 "Consumer is push based"): the
    fetch raises, for the caller to pause, instead of returning nothing to be asked again
    thousands of times a second."""
    async with Connection(make_settings(nats_server.url).nats, "puller") as conn:
        await _stream(conn, deliver_subject="elsewhere")
        pull = await _pull(conn)
        try:
            with pytest.raises(PullLost, match="409"):
                await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
        finally:
            await pull.stop()
            await conn.jsm().delete_stream(STREAM)


async def test_what_came_and_was_not_fetched_is_handed_back_at_stop(conn: Connection) -> None:
    """Deliveries still unfetched when the pull stops go back to the server at once (a nak),
    so the next pull has them now, not after their 30 s ack wait."""
    pull = await _pull(conn)
    await conn.js.publish("pt.a", b"one")
    got = await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
    assert [m.data for m in got] == [b"one"]
    await got[0].ack()
    await conn.js.publish("pt.b", b"two")  # taken by the request still open, not fetched
    await conn.js.publish("pt.c", b"three")
    await eventually(lambda: holds(len(pull._got) == 2), timeout=5, what="both delivered")
    await pull.stop()
    again = await _pull(conn)
    try:
        got = await asyncio.wait_for(again.fetch(16, LONG_PULL_S), 5)
        if len(got) < 2:
            got += await asyncio.wait_for(again.fetch(16, LONG_PULL_S), 5)
        assert sorted(m.data for m in got) == [b"three", b"two"]
    finally:
        await again.stop()


async def test_heartbeats_keep_a_quiet_pull_open(conn: Connection) -> None:
    """A pull with nothing to deliver hears the server's idle heartbeats and is not taken for
    lost; it ends at its expiry with nothing, and the next one brings what comes."""
    pull = await _pull(conn, hb=0.1)
    try:
        began = time.monotonic()
        assert await asyncio.wait_for(pull.fetch(16, 1.0), 5) == []
        assert time.monotonic() - began >= 0.9  # waited out its 1 s, through ~9 heartbeats
        await conn.js.publish("pt.c", b"three")
        got = await asyncio.wait_for(pull.fetch(16, 1.0), 5)
        assert [m.data for m in got] == [b"three"]
    finally:
        await pull.stop()


async def test_a_reconnect_ends_a_waiting_fetch_and_the_next_one_brings_the_message(
    nats_server: NatsServer,
) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    try:
        settings = make_settings(proxy.url)
        settings.nats.reconnect_wait = 0.05
        async with (
            Connection(settings.nats, "puller") as conn,
            Connection(make_settings(nats_server.url).nats, "sender") as sender,
        ):
            await _stream(sender)
            pull = await _pull(conn, hb=5.0)  # heartbeats too far apart to be what ends it
            try:
                waiting = asyncio.create_task(pull.fetch(16, LONG_PULL_S))
                await asyncio.sleep(0.3)
                reconnects = conn.reconnects
                proxy.cut(0.3)
                assert await asyncio.wait_for(waiting, 5) == []
                assert conn.reconnects == reconnects + 1
                await sender.js.publish("pt.d", b"four")
                got = await asyncio.wait_for(pull.fetch(16, LONG_PULL_S), 5)
                assert [m.data for m in got] == [b"four"]
            finally:
                await pull.stop()
                await sender.jsm().delete_stream(STREAM)
    finally:
        await proxy.stop()


async def test_messages_dropped_elsewhere_on_a_live_link_ask_for_no_second_pull(
    conn: Connection,
) -> None:
    """A slow consumer elsewhere on the connection (messages dropped, no reconnect) leaves the
    open pull request alone: it is not ended, and no second one is sent. Before, every drop
    ended the fetch and the next asked again, piling pull requests up at the hub."""
    pull = await _pull(conn, hb=5.0)
    try:
        waiting = asyncio.create_task(pull.fetch(16, LONG_PULL_S))
        await eventually(lambda: _waiting_pulls(conn, 1), what="the pull request at the server")
        for _ in range(3):
            conn._lost()  # as nats-py's slow-consumer error makes it
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await conn.js.publish("pt.e", b"five")
        assert [m.data for m in await asyncio.wait_for(waiting, 5)] == [b"five"]
        assert pull._count == 1
    finally:
        await pull.stop()


async def _waiting_pulls(conn: Connection, n: int) -> bool:
    return (await conn.jsm().consumer_info(STREAM, CONSUMER)).num_waiting == n


async def test_a_refused_reset_is_not_asked_for_again(conn: Connection) -> None:
    """A server before 2.14 answers ``CONSUMER.RESET`` "bad request": the pull says so once and
    leaves lost deliveries to the ack wait, rather than ask again after every link loss. A
    reset that fails in passing (no answer in time: an election, a link dropping again) is
    asked for again at the next look, and given up after three in a row (credentials without
    the right: a permission violation gets no answer), then asked for again a minute later:
    the pull gave up for good, and each delivery a link took waited out the ack wait until the
    process restarted."""
    pull = await _pull(conn)
    calls: list[str] = []
    api_call = pull._api_call
    failure: list[Exception] = [Refused("RESET", {"code": 400, "description": "bad request"})]

    async def refusing(call: str) -> dict[str, object]:
        calls.append(call)
        if call == "RESET":
            raise failure[0]
        return await api_call(call)

    pull._api_call = refusing  # type: ignore[method-assign]
    try:
        await conn.js.publish("pt.a", b"x")
        assert len(await pull.fetch(1, 5.0)) == 1  # held unacked, as one lost with a link
        pull.link_lost = True
        await pull.redeliver()
        assert calls == ["INFO", "RESET"] and not pull.link_lost
        pull.link_lost = True
        await pull.redeliver()
        assert calls == ["INFO", "RESET", "INFO"] and not pull.link_lost

        pull._failed_resets, failure[0] = 0, asyncio.TimeoutError()
        calls.clear()
        for tries in range(1, RESET_TRIES + 1):
            pull.link_lost = pull.link_lost or tries == 1
            await pull.redeliver()
            assert calls == ["INFO", "RESET"] * tries
            assert pull.link_lost == (tries < RESET_TRIES)  # looked at again, until given up
        assert not pull._resets
        # A timeout says nothing lasting: asked again a while later (it stopped for good).
        assert pull._reset_again_at is not None
        pull._reset_again_at = time.monotonic()  # the while has passed
        failure[0] = asyncio.TimeoutError()
        calls.clear()
        pull.link_lost = True
        await pull.redeliver()
        assert calls == ["INFO", "RESET"]  # asked again; no answer again: later again
        assert not pull._resets and pull._reset_again_at > time.monotonic()
        pull._reset_again_at = time.monotonic()
        calls.clear()
        failure[0] = Refused("RESET", {"code": 403, "description": "forbidden"})
        pull.link_lost = True
        await pull.redeliver()
        assert calls == ["INFO", "RESET"]
        assert not pull._resets and pull._reset_again_at is None  # refused: never again
    finally:
        await pull.stop()
