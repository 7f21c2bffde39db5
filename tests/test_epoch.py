"""Whether a delivery is older than the consumer that delivered it (:mod:`cloud_node.epoch`),
against a real nats-server: a consumer deleted and made anew over a stream that kept its
messages delivers them again as first deliveries, one of them perhaps held by a worker still.
The epoch must see the consumer made anew even when its deliveries to this worker do not count
from lower than before (other workers took the low sequences first)."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg
from nats.js import api

from cloud_node import epoch
from cloud_node.epoch import QueueEpoch
from mesh.connection import Connection

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
    """``lost``: the worker heard the consumer was lost (a pull ended "Consumer Deleted");
    ``late``: it heard nothing (busy meanwhile), and its look has grown old."""
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
