"""Whether a delivery is older than the consumer that delivered it (:mod:`cloud_node.epoch`),
against a real nats-server: a consumer deleted and made anew over a stream that kept its
messages delivers them again as first deliveries, one of them perhaps held by a worker still.
The epoch must see the consumer made anew even when its deliveries to this worker do not count
from lower than before (other workers took the low sequences first)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg
from nats.js import api

from cloud_node import epoch
from cloud_node.epoch import QueueEpoch
from mesh.connection import Connection
from tests.helpers import eventually, holds

STREAM, CONSUMER = "EPOCHTEST", "pool"


async def _consumer(conn: Connection) -> None:
    await conn.jsm().add_consumer(
        STREAM, api.ConsumerConfig(durable_name=CONSUMER, ack_policy=api.AckPolicy.EXPLICIT)
    )


async def _fetch(conn: Connection, n: int) -> list[Msg]:
    sub = await conn.js.pull_subscribe_bind(CONSUMER, STREAM)
    msgs = await sub.fetch(n, timeout=5)
    await sub.unsubscribe()
    return msgs


@pytest.mark.parametrize("heard", ["lost", "late"])
async def test_a_consumer_made_anew_is_seen_without_sequences_going_back(
    conn: Connection, heard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lost``: the worker heard the consumer was lost (JetStream's advisory, a pull ended
    "Consumer Deleted"); ``late``: it heard nothing (the advisory lost), and its look has grown
    old (no look ahead made it young)."""
    await conn.jsm().add_stream(api.StreamConfig(name=STREAM, subjects=["ep.>"]))
    try:
        await _consumer(conn)
        watch = QueueEpoch(conn, timeout=2.0)
        for i in range(3):
            await conn.js.publish(f"ep.{i}", b"x")
        first = (await _fetch(conn, 1))[0]
        assert not await watch.predates(first)  # stored after its consumer was made
        await conn.jsm().delete_consumer(STREAM, CONSUMER)
        await _consumer(conn)  # made anew: it delivers the three again
        again = await _fetch(conn, 3)
        later = again[2]  # sequence 3 here, above the 1 the epoch saw
        assert later.metadata.sequence.consumer > first.metadata.sequence.consumer
        if heard == "lost":
            watch.forget()
        else:
            monkeypatch.setattr(epoch, "LOOK_AGAIN_S", 0.0)
        assert await watch.predates(later)
    finally:
        await conn.jsm().delete_stream(STREAM)


async def test_looks_are_made_ahead_so_that_a_delivery_waits_for_none(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each look has the next made a while later, with no delivery asking: a delivery long
    after the worker's first look finds a young one and does not wait. Before, the first
    delivery after 5 s quiet paid a ``CONSUMER.INFO`` round trip (0.63 ms p50 on loopback)
    before its engine was asked: every request did, when requests came further apart than
    that. A look ahead that fails leaves the good one in place, and the looks go on."""
    monkeypatch.setattr(epoch, "LOOK_AHEAD_S", 0.05)
    monkeypatch.setattr(epoch, "LOOK_AGAIN_S", 0.3)
    await conn.jsm().add_stream(api.StreamConfig(name=STREAM, subjects=["ep.>"]))
    watch = QueueEpoch(conn, timeout=5.0)
    try:
        await _consumer(conn)
        looks, slow = _slow_looks(conn, monkeypatch)
        slow.set()  # looks answer at once, until told otherwise
        await watch.look(STREAM, CONSUMER)  # as the worker's start does
        await conn.js.publish("ep.0", b"x")
        (first,) = await _fetch(conn, 1)
        fail = True
        manager = type(conn.jsm())
        info = manager.consumer_info

        async def failing_once(self: object, stream: str, consumer: str) -> object:
            nonlocal fail
            if fail:  # the first look ahead fails
                fail = False
                raise TimeoutError
            return await info(self, stream, consumer)  # type: ignore[arg-type]

        monkeypatch.setattr(manager, "consumer_info", failing_once)
        began = time.monotonic()
        await eventually(lambda: holds(len(looks) >= 8), what="looks made ahead, none asked")
        assert not fail and time.monotonic() - began > 0.3  # the first look is old by now
        looks.clear()
        slow.clear()  # the next look will not come back...
        await eventually(lambda: holds(len(looks) == 1), what="a look ahead under way")
        # ...and the delivery does not wait for it: the look it knows is young.
        assert not await asyncio.wait_for(watch.predates(first), 0.2)
        timer = watch._timers[CONSUMER]
        watch.close()  # the worker stops: no more looks
        assert timer.cancelled()
        slow.set()
    finally:
        watch.close()
        await conn.jsm().delete_stream(STREAM)


async def test_a_look_begun_before_the_consumer_was_heard_lost_counts_for_nothing(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look still under way when the worker hears its consumer was lost may have seen the
    consumer before it was made anew: what it brings back must not stand over the look made
    after (a delivery of the new consumer would be taken for one nobody holds)."""
    monkeypatch.setattr(epoch, "LOOK_AHEAD_S", 0.05)
    await conn.jsm().add_stream(api.StreamConfig(name=STREAM, subjects=["ep.>"]))
    try:
        await _consumer(conn)
        watch = QueueEpoch(conn, timeout=5.0)
        await watch.look(STREAM, CONSUMER)
        for i in range(3):
            await conn.js.publish(f"ep.{i}", b"x")
        (first,) = await _fetch(conn, 1)
        assert not await watch.predates(first)
        looks, slow = _slow_looks(conn, monkeypatch)
        # The next look ahead reads the consumer now and comes back only once told.
        await eventually(lambda: holds(len(looks) == 1), what="a look ahead under way")
        monkeypatch.setattr(epoch, "LOOK_AHEAD_S", 60.0)
        await conn.jsm().delete_consumer(STREAM, CONSUMER)
        await _consumer(conn)  # made anew
        old = watch._looking[CONSUMER]
        watch.forget()  # heard (the advisory)
        again = await _fetch(conn, 2)
        assert await watch.predates(again[1])  # a look of its own, after the forget
        slow.set()  # the old look comes back now
        await old
        (third,) = await _fetch(conn, 1)
        assert third.metadata.sequence.consumer == 3
        assert await watch.predates(third)  # the old look's word did not stand
        assert len(looks) == 2
    finally:
        watch.close()
        await conn.jsm().delete_stream(STREAM)


def _slow_looks(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], asyncio.Event]:
    """The epoch's first look from here on reads the consumer at once and comes back only once
    the event is set; those after it are as usual. The looks asked, by consumer."""
    jsm = conn.jsm()
    info = type(jsm).consumer_info
    looks: list[str] = []
    slow = asyncio.Event()

    async def consumer_info(self: object, stream: str, consumer: str, *a: object, **k: object):  # type: ignore[no-untyped-def]
        looks.append(consumer)
        seen = await info(self, stream, consumer, *a, **k)  # type: ignore[arg-type]
        if len(looks) == 1:
            await slow.wait()
        return seen

    monkeypatch.setattr(type(jsm), "consumer_info", consumer_info)
    return looks, slow
