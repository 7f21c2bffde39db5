"""Inline subscriptions (``mesh.inline_sub``) against a real nats-server, with the nats-py this
project installs: they lean on one of its private attributes, so these tests say at once if an
upgrade changed what they rely on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh.inline_sub import Inboxes, make_inline, subscribe_inline
from mesh.nats_server import NatsServer
from mesh.testing.chaos import Server

N = 500


class Got(list[bytes]):
    """Payloads a handler was given, and a wait for a count of them (an event, not a poll)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def take(self, msg: Msg) -> None:
        self.append(msg.data)
        self.changed.set()

    async def reach(self, n: int, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self) < n:
                self.changed.clear()
                await self.changed.wait()


async def test_messages_reach_the_handler_in_order_from_the_read_loop(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    pub: Client | None = None
    got = Got()
    tasks: set[asyncio.Task[object] | None] = set()

    def handler(msg: Msg) -> None:
        got.take(msg)
        tasks.add(asyncio.current_task())

    try:
        sub = await subscribe_inline(nc, "inline.order", handler)
        await nc.flush()
        # The publisher connects once the subscription is in. One flush right after a subscribe
        # can be answered before the server read the SUB (nats-py writes the PING at once, the
        # SUB a loop turn later; mesh.connection.Connection.subscribed flushes twice).
        pub = await nats.connect(nats_server.url)
        for i in range(N):
            await pub.publish("inline.order", str(i).encode())
        await pub.flush()
        await got.reach(N)
        assert got == [str(i).encode() for i in range(N)]
        assert sub._wait_for_msgs_task is None  # no task of its own per subscription
        assert len(tasks) == 1  # all handled in one task: the connection's read loop
        assert sub.pending_msgs == 0 and sub.pending_bytes == 0
        await sub.unsubscribe()
        await pub.publish("inline.order", b"after")
        await pub.flush()
        await nc.flush()
        assert got[-1] == str(N - 1).encode()  # nothing after the unsubscribe
    finally:
        await nc.close()
        if pub is not None:
            await pub.close()


async def test_a_callback_subscription_made_inline_hands_on_what_waits_in_its_queue_in_order(
    nats_server: NatsServer,
) -> None:
    """``make_inline`` (the edge's ``infer`` endpoint, which nats-py's micro service subscribes
    with a callback): the callback's task stops, the messages queued behind it reach the handler
    first, in order, and every later one from the read loop."""
    nc = await nats.connect(nats_server.url)
    got, in_callback = Got(), Got()
    held = asyncio.Event()

    async def callback(msg: Msg) -> None:
        in_callback.take(msg)
        await held.wait()  # holds the subscription's task: the rest queue up behind it

    try:
        sub = await nc.subscribe("inline.made", cb=callback)
        for i in range(20):
            await nc.publish("inline.made", str(i).encode())
        await in_callback.reach(1)
        await nc.flush()  # the server sent all 20 back before it answered the PING
        assert sub.pending_msgs == 19
        task = sub._wait_for_msgs_task
        make_inline(sub, got.take)
        assert got == [str(i).encode() for i in range(1, 20)]
        for i in range(20, 40):
            await nc.publish("inline.made", str(i).encode())
        await got.reach(39)
        assert got == [str(i).encode() for i in range(1, 40)]
        assert in_callback == [b"0"]
        assert task is not None and task.done()  # it ends when cancelled
        assert sub.pending_msgs == 0 and sub.pending_bytes == 0
        await sub.unsubscribe()
    finally:
        await nc.close()


async def test_a_handler_that_raises_loses_that_message_only(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    got = Got()

    def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("a bug in the handler")
        got.take(msg)

    try:
        await subscribe_inline(nc, "inline.raise", handler)
        for data in (b"1", b"bad", b"2"):
            await nc.publish("inline.raise", data)
        await got.reach(2)
        assert got == [b"1", b"2"]
        assert nc.is_connected
    finally:
        await nc.close()


async def test_drain_returns_and_a_queue_group_shares_the_messages(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    a, b = Got(), Got()
    b.changed = a.changed  # one wake-up for either
    try:
        sub_a = await subscribe_inline(nc, "inline.q", a.take, queue="g")
        sub_b = await subscribe_inline(nc, "inline.q", b.take, queue="g")
        await nc.flush()
        for i in range(100):
            await nc.publish("inline.q", str(i).encode())
        async with asyncio.timeout(10):
            while len(a) + len(b) < 100:
                a.changed.clear()
                await a.changed.wait()
        assert sorted(a + b, key=int) == [str(i).encode() for i in range(100)]
        await asyncio.wait_for(sub_a.drain(), 5)
        await asyncio.wait_for(sub_b.drain(), 5)
    finally:
        await nc.close()


async def test_the_subscription_delivers_again_after_the_server_restarts(tmp_path: Path) -> None:
    server = Server(tmp_path / "store")
    await server.start()
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(
        server.url, reconnected_cb=on_reconnect, reconnect_time_wait=0.1, max_reconnect_attempts=-1
    )
    got = Got()
    try:
        await subscribe_inline(nc, "inline.restart", got.take)
        await nc.publish("inline.restart", b"before")
        await got.reach(1)
        assert got == [b"before"]
        await server.restart(outage=0.3)
        await asyncio.wait_for(reconnected.wait(), 15)
        await nc.publish("inline.restart", b"after")
        await got.reach(2)
        assert got == [b"before", b"after"]
    finally:
        await nc.close()
        await server.stop()


async def test_reply_inboxes_share_one_subscription_and_each_gets_its_own_messages(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    pub = await nats.connect(nats_server.url)
    try:
        inboxes = Inboxes(nc.new_inbox())
        subs_before = len(nc._subs)
        got = [Got() for _ in range(3)]
        names = [inboxes.new() for _ in got]
        listening = [await inboxes.listen(nc, n, g.take) for n, g in zip(names, got, strict=True)]
        assert len(set(names)) == 3 and all(n.startswith(inboxes.prefix + ".") for n in names)
        assert len(nc._subs) == subs_before + 1  # one wildcard, not one per inbox
        await nc.flush()
        await pub.flush()  # after nc's flush: see the first test
        for round_ in range(2):
            for i, name in enumerate(names):
                await pub.publish(name, f"{i}-{round_}".encode())
            await pub.flush()
            if round_ == 0:
                for g in got:
                    await g.reach(1)
                await listening[1].unsubscribe()  # the second inbox is done with
        await got[2].reach(2)
        await got[0].reach(2)
        assert got[0] == [b"0-0", b"0-1"]
        assert got[1] == [b"1-0"]  # nothing after it stopped listening, nor elsewhere
        assert got[2] == [b"2-0", b"2-1"]
        await pub.publish(f"{inboxes.prefix}.unknown", b"stray")  # nobody's: dropped
        await pub.flush()
        await nc.flush()
        assert [len(g) for g in got] == [2, 1, 2]
        await inboxes.close()  # a client sharing its connection leaves no subscription behind
        assert len(nc._subs) == subs_before
    finally:
        await pub.close()
        await nc.close()
