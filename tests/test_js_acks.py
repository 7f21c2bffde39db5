"""``Connection.publish_acked`` (mesh.js_acks): JetStream publishes whose acks are read in the
connection's read loop, against a real nats-server. Each outcome is the one nats-py's
``js.publish`` gives, to the type."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import nats.errors
import pytest
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings
from tests.helpers import eventually, holds


@contextlib.asynccontextmanager
async def _through_a_proxy(
    server: NatsServer, name: str
) -> AsyncIterator[tuple[TcpProxy, Connection]]:
    """A connection whose link goes through a proxy (to cut), reconnecting within 0.1 s."""
    proxy = await TcpProxy(server.port).start()
    settings = make_settings(proxy.url)
    settings.nats.reconnect_wait = 0.1
    try:
        async with Connection(settings.nats, name) as conn:
            yield proxy, conn
    finally:
        await proxy.stop()


async def test_acks_name_the_stream_and_the_sequence_and_each_publish_gets_its_own(
    conn: Connection, js_stream: tuple[str, str]
) -> None:
    name, subject = js_stream
    first = await conn.publish_acked(f"{subject}.a", b"one", stream=name)
    assert (first.stream, first.seq, first.duplicate) == (name, 1, None)
    acks = await asyncio.gather(
        *(conn.publish_acked(f"{subject}.b", f"{i}".encode(), stream=name) for i in range(200))
    )
    assert sorted(a.seq for a in acks) == list(range(2, 202))
    info = await conn.jsm().stream_info(name)
    assert info.state.messages == 201


async def test_a_repeated_message_id_is_acked_as_a_duplicate(
    conn: Connection, js_stream: tuple[str, str]
) -> None:
    name, subject = js_stream
    headers = {"Nats-Msg-Id": "same"}
    once = await conn.publish_acked(f"{subject}.a", b"x", stream=name, headers=headers)
    again = await conn.publish_acked(f"{subject}.a", b"x", stream=name, headers=headers)
    assert not once.duplicate and again.duplicate and again.seq == once.seq


async def test_the_stores_refusals_are_typed_as_through_nats_py(
    conn: Connection, js_stream: tuple[str, str]
) -> None:
    _name, subject = js_stream
    with pytest.raises(APIError) as wrong_stream:
        await conn.publish_acked(f"{subject}.a", b"x", stream="NOT_THIS_ONE")
    assert wrong_stream.value.err_code == 10060  # expected stream does not match
    with pytest.raises(NoStreamResponseError):  # the server says nobody takes the subject
        await conn.publish_acked(f"nostream.{uuid.uuid4().hex}", b"x")
    # nats-py raises the same for each.
    with pytest.raises(APIError) as through_nats_py:
        await conn.js.publish(f"{subject}.a", b"x", stream="NOT_THIS_ONE")
    assert through_nats_py.value.err_code == wrong_stream.value.err_code


async def test_an_ack_that_never_comes_times_out_in_time(conn: Connection) -> None:
    subject = f"silent.{uuid.uuid4().hex}"
    listener = await conn.nc.subscribe(subject)  # someone is there, and never answers
    try:
        began = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):
            await conn.publish_acked(subject, b"x", timeout=0.3)
        assert 0.25 <= time.monotonic() - began < 2.0
    finally:
        await listener.unsubscribe()


@pytest.mark.parametrize("missing", [True, False])
async def test_a_slow_ack_asks_whether_its_stream_is_gone(conn: Connection, missing: bool) -> None:
    """A subject whose stream was deleted, with a reader on it: no ack and no "no responders"
    ever come. Given a ``gone`` check, a publish asks it after 1 s, and ends then when the
    stream is gone; when the stream is there, it waits for its ack up to its timeout."""
    subject = f"silent.{uuid.uuid4().hex}"
    listener = await conn.nc.subscribe(subject)
    asked = 0

    async def gone() -> bool:
        nonlocal asked
        asked += 1
        return missing

    try:
        began = time.monotonic()
        with pytest.raises(NoStreamResponseError if missing else nats.errors.TimeoutError):
            await conn.publish_acked(subject, b"x", timeout=2.5, gone=gone)
        took = time.monotonic() - began
        assert asked == 1
        assert (0.9 <= took < 2.0) if missing else (2.4 <= took < 4.0), took
    finally:
        await listener.unsubscribe()


async def test_told_its_stream_is_gone_a_waiting_publish_ends_at_once(conn: Connection) -> None:
    """JetStream said the stream was deleted (``Connection.stream_gone``): the publishes waiting
    for its ack that were given that ``gone`` check end now, typed as "no stream"; one given
    another check, or none, waits on."""
    subject = f"silent.{uuid.uuid4().hex}"
    listener = await conn.nc.subscribe(subject)

    async def gone() -> bool:
        return False

    async def other() -> bool:
        return False

    try:
        told = asyncio.ensure_future(conn.publish_acked(subject, b"x", timeout=30, gone=gone))
        others = [
            asyncio.ensure_future(conn.publish_acked(subject, b"y", timeout=30, gone=other)),
            asyncio.ensure_future(conn.publish_acked(subject, b"z", timeout=30)),
        ]
        acks = conn._acks
        assert acks is not None
        await eventually(lambda: holds(len(acks._pending) == 3), what="three publishes waiting")
        began = time.monotonic()
        assert conn.stream_gone(gone) == 1
        with pytest.raises(NoStreamResponseError):
            await told
        assert time.monotonic() - began < 0.5
        assert not any(o.done() for o in others)
        for waiting in others:
            waiting.cancel()
        assert conn.stream_gone(gone) == 0
    finally:
        await listener.unsubscribe()


async def test_a_look_still_under_way_ends_with_its_publish_and_with_the_connection(
    nats_server: NatsServer,
) -> None:
    """A look that hangs (a hub that answers nothing) is cancelled when its publish ends, and
    any still under way when the connection closes. Before, each ran on to its own timeout,
    holding the closed connection."""
    hung: list[asyncio.Event] = []

    async def gone() -> bool:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            hung.append(asyncio.Event())
            raise
        return False

    subject = f"silent.{uuid.uuid4().hex}"
    async with Connection(make_settings(nats_server.url).nats, "acks") as conn:
        listener = await conn.nc.subscribe(subject)
        with pytest.raises(nats.errors.TimeoutError):
            await conn.publish_acked(subject, b"x", timeout=1.3, gone=gone)
        await eventually(lambda: holds(len(hung) == 1), what="the look cancelled with its publish")
        waiting = asyncio.ensure_future(conn.publish_acked(subject, b"y", timeout=30, gone=gone))
        acks = conn._acks
        assert acks is not None
        await eventually(lambda: holds(bool(acks._looks)), what="its look under way")
        await listener.unsubscribe()
    await eventually(lambda: holds(len(hung) == 2), what="the look cancelled with the connection")
    waiting.cancel()


async def test_publishes_are_acked_again_after_the_link_comes_back(
    nats_server: NatsServer, conn: Connection, js_stream: tuple[str, str]
) -> None:
    """The acks' subscription is a plain one: nats-py restores it with the connection."""
    name, subject = js_stream
    async with _through_a_proxy(nats_server, "acks-cut") as (proxy, cut):
        assert (await cut.publish_acked(f"{subject}.a", b"before", stream=name)).seq == 1
        proxy.cut(1.0)

        async def back() -> bool:
            return cut.reconnects >= 1 and cut.connected

        await eventually(back, 10, "the link back")
        ack = await cut.publish_acked(f"{subject}.a", b"after", stream=name)
        assert ack.seq == 2 and not ack.duplicate


async def test_a_publish_lost_in_the_dying_link_is_published_again_once_the_link_is_back(
    nats_server: NatsServer, js_stream: tuple[str, str]
) -> None:
    """With a message id, it is published again on the reconnect and acked at once, stored
    once; without one, it is left to its timeout (published twice it could be stored twice)."""
    name, subject = js_stream
    async with _through_a_proxy(nats_server, "acks-lost") as (proxy, cut):
        await cut.publish_acked(f"{subject}.warm", b"subscribed", stream=name)
        proxy.swallow()
        with_id = asyncio.create_task(
            cut.publish_acked(
                f"{subject}.a", b"kept", stream=name, headers={"Nats-Msg-Id": "m1"}, timeout=30
            )
        )
        without = asyncio.create_task(
            cut.publish_acked(f"{subject}.b", b"left", stream=name, timeout=3)
        )

        async def both_swallowed() -> bool:
            return b"kept" in proxy.swallowed and b"left" in proxy.swallowed

        await eventually(both_swallowed, 10, "both publishes to go into the dying link")
        proxy.cut(0.2)
        began = time.monotonic()
        ack = await asyncio.wait_for(with_id, 10)
        took = time.monotonic() - began
        print(f"\nthe link cut -> the ack of the publish sent again: {took:.3f} s")
        assert ack.seq == 2 and not ack.duplicate
        with pytest.raises(nats.errors.TimeoutError):
            await without
        info = await cut.jsm().stream_info(name)
        assert info.state.messages == 2  # the warm-up, and the one published again once


async def test_a_publish_lost_to_a_short_silence_is_sent_again_without_a_reconnect(
    nats_server: NatsServer, js_stream: tuple[str, str]
) -> None:
    """A link that goes silent for a moment (a leaf's uplink or a route that dropped and came
    back, a client's link frozen) loses what it carried, and no reconnect comes to send it
    again: with a message id it is sent again each second its ack does not come, acked within
    a second of the link's return and stored once; before, it waited out its timeout. Without
    an id it is left to its timeout, as through nats-py."""
    name, subject = js_stream
    async with _through_a_proxy(nats_server, "acks-silent") as (proxy, link):
        await link.publish_acked(f"{subject}.warm", b"subscribed", stream=name)
        proxy.freeze()
        with_id = asyncio.create_task(
            link.publish_acked(
                f"{subject}.a", b"kept", stream=name, headers={"Nats-Msg-Id": "s1"}, timeout=10
            )
        )
        without = asyncio.create_task(
            link.publish_acked(f"{subject}.b", b"left", stream=name, timeout=4)
        )
        await asyncio.sleep(1.5)  # the fault's length: shorter than a ping can tell
        proxy.restore()
        back = time.monotonic()
        ack = await asyncio.wait_for(with_id, 10)
        took = time.monotonic() - back
        print(f"\nthe link back -> the ack of the publish sent again: {took:.3f} s")
        assert took < 1.5 and ack.seq == 2 and not ack.duplicate
        with pytest.raises(nats.errors.TimeoutError):
            await without
        assert link.drops == 0  # no reconnect sent it again
        info = await link.jsm().stream_info(name)
        assert info.state.messages == 2  # the warm-up, and the lost one once


async def test_acks_a_slow_link_brings_late_are_not_taken_for_losses(
    nats_server: NatsServer, conn: Connection, js_stream: tuple[str, str]
) -> None:
    """Over a link whose acks come 1.1 s late (its round trip, measured at connect), nothing is
    sent again: each publish reaches the server once (with a resend each second its ack had
    not come, twice, 100 kB each)."""
    name, subject = js_stream
    copies: list[bytes] = []

    async def seen(msg: Msg) -> None:
        copies.append(msg.data)

    listener = await conn.nc.subscribe(f"{subject}.slow.>", cb=seen)
    await conn.subscribed()
    proxy = await TcpProxy(nats_server.port).start()
    proxy.delay_down = 1.1
    try:
        async with Connection(make_settings(proxy.url).nats, "acks-slow") as slow:
            acks = await asyncio.gather(
                *(
                    slow.publish_acked(
                        f"{subject}.slow.{i}",
                        b"x" * 100_000,
                        stream=name,
                        headers={"Nats-Msg-Id": f"slow{i}"},
                        timeout=6,
                    )
                    for i in range(5)
                )
            )
            assert sorted(a.seq for a in acks) == [1, 2, 3, 4, 5]
            await conn.nc.flush(timeout=2)
            assert len(copies) == 5, f"{len(copies)} copies of 5 publishes reached the server"
    finally:
        await listener.unsubscribe()
        await proxy.stop()


async def test_before_connect_and_after_close_it_says_so(nats_server: NatsServer) -> None:
    conn = Connection(make_settings(nats_server.url).nats, "acks-closed")
    with pytest.raises(RuntimeError, match="not connected"):
        await conn.publish_acked("any", b"x")
    async with conn:
        pass
    with pytest.raises(RuntimeError, match="not connected"):
        await conn.publish_acked("any", b"x")
