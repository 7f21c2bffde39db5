"""The outbox: answer events written together, in order, without holding back a first token.

Real nats-server; the outbox publishes on one connection, a plain subscriber on another reads.
"""

from __future__ import annotations

import asyncio

import nats
import pytest

from cloud_node.publisher import AnswerPublisher
from mesh.answer_store import AnswerStore, ensure_answer_stream
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.outbox import Outbox
from protocol.codec import WireFormat
from protocol.errors import ErrorCode, MeshError
from protocol.messages import EndEvent, TokenEvent, Usage
from protocol.stream import AnswerWriter

HEADERS = {"Content-Type": "text/plain"}


async def _reader(server: NatsServer, subject: str) -> tuple[nats.NATS, list[bytes], asyncio.Event]:
    nc = await nats.connect(server.url)
    got: list[bytes] = []
    changed = asyncio.Event()

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)
        changed.set()

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return nc, got, changed


async def _until(got: list[bytes], changed: asyncio.Event, count: int) -> None:
    async def wait() -> None:
        while len(got) < count:
            changed.clear()
            await changed.wait()

    await asyncio.wait_for(wait(), 10)


async def test_a_burst_is_one_write_in_order(nats_server: NatsServer) -> None:
    reader, got, changed = await _reader(nats_server, "outbox.burst")
    nc = await nats.connect(nats_server.url)
    try:
        box = Outbox(nc, gap=0.001)
        sent = [f"m{i}".encode() for i in range(200)]
        for data in sent:
            box.put("outbox.burst", data, HEADERS)
        await _until(got, changed, 200)
        assert got == sent
        assert box.writes == 1  # without the outbox: nats-py wrote as often as the loop turned
    finally:
        await nc.close()
        await reader.close()


async def test_a_busy_outbox_holds_events_but_never_a_first_one(nats_server: NatsServer) -> None:
    reader, got, changed = await _reader(nats_server, "outbox.gap")
    nc = await nats.connect(nats_server.url)
    try:
        box = Outbox(nc, gap=30.0)
        box.put("outbox.gap", b"first", HEADERS)  # after a quiet spell: at once
        await _until(got, changed, 1)
        box.put("outbox.gap", b"held", HEADERS)  # within the gap of the last write: held
        await nc.publish("outbox.gap", b"direct, later")  # not through the outbox
        await _until(got, changed, 2)
        assert got == [b"first", b"direct, later"]
        box.put("outbox.gap", b"first of another answer", HEADERS, now=True)
        await _until(got, changed, 4)  # goes at once, and takes what was held with it, in order
        assert got[2:] == [b"held", b"first of another answer"]
        box.put("outbox.gap", b"last token", HEADERS)
        assert await box.flush()  # before an end published directly
        await nc.publish("outbox.gap", b"end")
        await _until(got, changed, 6)
        assert got[4:] == [b"last token", b"end"]
    finally:
        await nc.close()
        await reader.close()


async def test_events_that_cannot_be_published_make_the_next_put_raise(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    box = Outbox(nc, gap=0.0)
    box.put("outbox.closed", b"before", HEADERS)
    assert await box.flush()
    await nc.close()
    box.put("outbox.closed", b"lost", HEADERS)
    assert not await box.flush()
    with pytest.raises(MeshError) as raised:
        box.put("outbox.closed", b"refused", HEADERS)
    assert raised.value.code == ErrorCode.UNAVAILABLE
    assert "ConnectionClosedError" in raised.value.message


async def test_a_dropped_burst_is_published_again_before_the_answer_counts(
    conn: Connection, settings: MeshSettings
) -> None:
    """A burst that fails part-way drops what was queued behind the failure, this answer's
    tokens included, with no reconnect to say so. The worker's publisher notices at the end and
    publishes again what the answer store lacks: the kept answer is whole."""
    await ensure_answer_stream(conn.jsm(), settings.stream)
    store = AnswerStore(conn, settings.stream, filtered=False)
    publisher = AnswerPublisher(conn, store, "outboxtest", "req-1", WireFormat.MSGPACK, timeout=5)
    writer = AnswerWriter("req-1", attempt=1, node="cloud:test")
    await publisher.send(writer.start())
    await publisher.send(writer.token("a"))
    assert await conn.outbox.flush()
    # Too large for the server: the burst stops there, and the tokens queued after it are lost.
    conn.outbox.put("outbox.poison", b"x" * (conn.nc.max_payload + 1), None)
    await publisher.send(writer.token("b"))
    await publisher.send(writer.token("c"))
    assert not await conn.outbox.flush()
    end = writer.end(finish_reason="stop", usage=Usage(completion_tokens=3))
    assert await publisher.finish(end)
    kept = await store.replay(publisher.subject, timeout=5)
    tokens = sorted((e for e in kept if isinstance(e, TokenEvent)), key=lambda e: e.seq)
    assert [(e.seq, e.text) for e in tokens] == [(0, "a"), (1, "b"), (2, "c")]
    assert [e.seq for e in kept if isinstance(e, EndEvent)] == [3]
    assert publisher.republished == 2
