"""The write batch: answer events written together, in order, without holding back a first token.

Real nats-server; the write batch publishes on one connection, a plain subscriber on another reads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from cloud_node import publisher as publisher_module
from cloud_node.publisher import AnswerPublisher
from mesh.answer_store import AnswerStore, ensure_answer_stream
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import Server
from mesh.write_batch import WriteBatch, _frame_with, header_block
from protocol.codec import WireFormat
from protocol.errors import ErrorCode, MeshError
from protocol.messages import EndEvent, TokenEvent, Usage
from protocol.stream import AnswerWriter
from tests.conftest import make_settings
from tests.helpers import eventually

HEADERS = {"Content-Type": "text/plain"}


async def _reader(server: NatsServer, subject: str) -> tuple[Client, list[bytes], asyncio.Event]:
    nc = await nats.connect(server.url)
    got: list[bytes] = []
    changed = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(msg.data)
        changed.set()

    await nc.subscribe(subject, cb=on_msg)
    await nc.flush()
    return nc, got, changed


def _is(test: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return test()

    return check


async def _until(got: list[bytes], changed: asyncio.Event, count: int) -> None:
    async def wait() -> None:
        while len(got) < count:
            changed.clear()
            await changed.wait()

    await asyncio.wait_for(wait(), 10)


async def test_a_burst_is_one_write_in_order(nats_server: NatsServer) -> None:
    reader, got, changed = await _reader(nats_server, "batch.burst")
    nc = await nats.connect(nats_server.url)
    try:
        box = WriteBatch(nc, gap=0.001)
        sent = [f"m{i}".encode() for i in range(200)]
        for data in sent:
            box.put("batch.burst", data, HEADERS)
        await _until(got, changed, 200)
        assert got == sent
        assert box.writes == 1  # without the write batch: nats-py wrote as often as the loop turned
    finally:
        await nc.close()
        await reader.close()


async def test_a_busy_write_batch_holds_events_but_never_a_first_one(
    nats_server: NatsServer,
) -> None:
    reader, got, changed = await _reader(nats_server, "batch.gap")
    nc = await nats.connect(nats_server.url)
    try:
        box = WriteBatch(nc, gap=30.0)
        box.put("batch.gap", b"first", HEADERS)  # after a quiet spell: at once
        await _until(got, changed, 1)
        box.put("batch.gap", b"held", HEADERS)  # within the gap of the last write: held
        await nc.publish("batch.gap", b"direct, later")  # not through the write batch
        await _until(got, changed, 2)
        assert got == [b"first", b"direct, later"]
        box.put("batch.gap", b"first of another answer", HEADERS, now=True)
        await _until(got, changed, 4)  # goes at once, and takes what was held with it, in order
        assert got[2:] == [b"held", b"first of another answer"]
        box.put("batch.gap", b"last token", HEADERS)
        assert await box.flush()  # before an end published directly
        await nc.publish("batch.gap", b"end")
        await _until(got, changed, 6)
        assert got[4:] == [b"last token", b"end"]
    finally:
        await nc.close()
        await reader.close()


async def test_a_burst_over_the_clients_buffer_still_goes_out_whole(
    nats_server: NatsServer,
) -> None:
    """The write batch publishes without a task; nats-py then waits for its flusher only when
    its buffer is over ``pending_size``, with the message already queued. Every message of such
    a burst arrives, in order, and nothing raises."""
    reader, got, changed = await _reader(nats_server, "batch.full")
    nc = await nats.connect(nats_server.url, pending_size=256)
    try:
        box = WriteBatch(nc, gap=0.001)
        sent = [f"m{i:03d}".encode() * 40 for i in range(50)]  # 160 bytes each
        for data in sent:
            box.put("batch.full", data, None)
        await _until(got, changed, 50)
        assert got == sent
        assert box.failures == 0
        box.put("batch.full", b"after", None)  # the write batch goes on
        await _until(got, changed, 51)
    finally:
        await nc.close()
        await reader.close()


async def test_events_that_cannot_be_published_make_the_next_put_raise(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    box = WriteBatch(nc, gap=0.0)
    box.put("batch.closed", b"before", HEADERS)
    assert await box.flush()
    await nc.close()
    box.put("batch.closed", b"lost", HEADERS)
    assert not await box.flush()
    with pytest.raises(MeshError) as raised:
        box.put("batch.closed", b"refused", HEADERS)
    assert raised.value.code == ErrorCode.UNAVAILABLE
    assert "ConnectionClosedError" in raised.value.message


async def _answer(
    conn: Connection, settings: MeshSettings, scope: str, *, timeout: float
) -> tuple[AnswerStore, AnswerPublisher, AnswerWriter]:
    """A worker's publisher and writer for answer ``req-1`` in ``scope``, its store provisioned."""
    await ensure_answer_stream(conn.jsm(), settings.stream)
    store = AnswerStore(conn, settings.stream, filtered=False)
    publisher = AnswerPublisher(conn, store, scope, "req-1", WireFormat.MSGPACK, timeout=timeout)
    return store, publisher, AnswerWriter("req-1", attempt=1, node="cloud:test")


def _tokens(events: Sequence[object]) -> list[tuple[int, str]]:
    """(position, text) of the stored tokens, in answer order (the store keeps arrival order)."""
    tokens = sorted((e for e in events if isinstance(e, TokenEvent)), key=lambda e: e.seq)
    return [(e.seq, e.text) for e in tokens]


async def test_a_message_too_large_is_skipped_and_other_answers_go_on(
    conn: Connection, settings: MeshSettings
) -> None:
    """One bad message costs only itself: the answer queued behind it in the same burst is
    published, and is not told of another's failure."""
    store, publisher, writer = await _answer(conn, settings, "batchtest", timeout=5)
    await publisher.send(writer.start())
    await publisher.send(writer.token("a"))
    assert await conn.write_batch.flush()
    conn.write_batch.put("batch.poison", b"x" * (conn.nc.max_payload + 1), None)
    await publisher.send(writer.token("b"))
    assert not await conn.write_batch.flush()  # the poison failed...
    await publisher.send(writer.token("c"))  # ...and this answer is not told of it
    with pytest.raises(MeshError):
        conn.write_batch.put("batch.poison", b"next", None)  # the poisoned subject is
    assert await publisher.finish(writer.end(finish_reason="stop", usage=Usage()))
    kept = await store.replay(publisher.subject, timeout=5)
    assert _tokens(kept) == [(0, "a"), (1, "b"), (2, "c")]
    assert publisher.republished == 0


async def test_tokens_lost_in_an_outage_reach_the_store_before_the_answer_counts(
    tmp_path: Path,
) -> None:
    """The server goes away mid-answer and the reconnect buffer fills up, so a burst with this
    answer's token is dropped. Catch-ups tried during the outage, and once more while the store
    cannot be read, fail. The end then makes sure the store holds every event: the kept answer
    is whole, and only then does the worker ack."""
    server = Server(tmp_path / "store")
    await server.start()
    settings = make_settings(server.url)
    conn = await Connection(settings.nats, "outage").connect()
    try:
        store, publisher, writer = await _answer(conn, settings, "outage", timeout=2)
        await publisher.send(writer.start())
        await publisher.send(writer.token("a"))
        assert await conn.write_batch.flush()
        await conn.nc.flush(timeout=5)
        await server.stop()
        await eventually(_is(lambda: not conn.connected), what="the connection sees the outage")
        for size in (4096, 64, 1):  # other traffic fills the reconnect buffer to the brim
            with contextlib.suppress(nats.errors.OutboundBufferLimitError):
                while True:
                    await conn.nc.publish("outage.junk", b"x" * size)
        await publisher.send(writer.token("b"))
        assert not await conn.write_batch.flush()  # dropped: the buffer is full
        assert not await publisher.catch_up()  # the store cannot be read during the outage
        await server.start()
        await eventually(_is(lambda: conn.connected), what="reconnected")
        # Back, but the store cannot be read for a moment (here: its stream is gone until it is
        # provisioned again). A catch-up then fails, and must not count as done.
        await conn.jsm().delete_stream(settings.stream.answer_stream)
        assert not await publisher.catch_up()
        await ensure_answer_stream(conn.jsm(), settings.stream)
        assert await publisher.finish(writer.end(finish_reason="stop", usage=Usage()))
        kept = await store.replay(publisher.subject, timeout=5)
        assert _tokens(kept) == [(0, "a"), (1, "b")]
        assert [e.seq for e in kept if isinstance(e, EndEvent)] == [2]
    finally:
        await conn.close()
        await server.stop()


async def test_an_answer_the_store_could_not_confirm_is_made_whole_when_it_can(
    conn: Connection, settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store cannot be reached when the answer ends (here its stream is gone), so the end
    cannot be confirmed and the worker acks without it. The publisher keeps trying: once the
    store is back, it holds the whole answer, for readers that re-read it to fill a gap."""
    monkeypatch.setattr(publisher_module, "CATCH_UP_RETRY_S", 0.01)  # the end's own retry
    store, publisher, writer = await _answer(conn, settings, "settle", timeout=1)
    await publisher.send(writer.start())
    await publisher.send(writer.token("a"))
    await conn.jsm().delete_stream(settings.stream.answer_stream)
    await publisher.send(writer.token("b"))
    assert not await publisher.finish(writer.end(finish_reason="stop", usage=Usage()))
    await ensure_answer_stream(conn.jsm(), settings.stream)
    assert await publisher.settle(within=15)
    kept = await store.replay(publisher.subject, timeout=5)
    assert _tokens(kept) == [(0, "a"), (1, "b")]
    assert [e.seq for e in kept if isinstance(e, EndEvent)] == [2]


async def test_a_burst_keeps_nats_pys_checks_and_its_order_around_messages_with_headers(
    nats_server: NatsServer,
) -> None:
    """The write batch writes plain messages as protocol lines of its own. A subject nats-py
    would refuse (a blank or line break: it could inject a protocol line) is refused the same
    way, that message alone; a message with headers goes through nats-py in its place; the
    burst arrives in order, and the connection stays up."""
    reader, got, changed = await _reader(nats_server, "batch.order")
    injected, seen, _ = await _reader(nats_server, "batch.injected")
    nc = await nats.connect(nats_server.url)
    try:
        box = WriteBatch(nc, gap=0.001)
        box.put("batch.order", b"one", None)
        box.put("batch.order 3\r\nPUB batch.injected", b"evil", None)
        box.put("batch.order", b"two", HEADERS)
        box.put("batch.order", b"three", None)
        assert not await box.flush()  # one message could not be published
        box.put("batch.order", b"four", None)
        await _until(got, changed, 4)
        assert got == [b"one", b"two", b"three", b"four"]
        assert box.failures == 1
        with pytest.raises(MeshError, match="BadSubjectError"):
            box.put("batch.order 3\r\nPUB batch.injected", b"again", None)
        await nc.flush(timeout=5)
        assert nc.is_connected and seen == []
    finally:
        await nc.close()
        await reader.close()
        await injected.close()


async def test_a_header_block_is_written_as_nats_py_writes_those_headers(
    nats_server: NatsServer,
) -> None:
    """A sender whose headers never change encodes them once (``header_block``); the write
    batch then writes its messages itself. The bytes are nats-py's own for the same headers,
    and a subscriber reads the headers back."""
    headers = {"Content-Type": "application/msgpack", " Padded ": " a\r\nb "}
    reader = await nats.connect(nats_server.url)
    got: list[bytes] = []
    seen: list[dict[str, str] | None] = []
    changed = asyncio.Event()

    async def note(msg: Msg) -> None:  # one subscription reads both, data and headers
        got.append(msg.data)
        seen.append(msg.headers)
        changed.set()

    await reader.subscribe("batch.headers", cb=note)
    await reader.flush()
    # The publisher connects after the subscription is in, and flushes once: one flush right
    # after a subscribe can be answered before the server read the SUB (nats-py writes the PING
    # at once, the SUB a loop turn later; mesh.connection.Connection.subscribed).
    nc = await nats.connect(nats_server.url)
    await nc.flush()
    try:
        await nc.publish("batch.headers", b"payload", headers=headers)
        line, rest = bytes(nc._pending[-1]).split(b"\r\n", 1)  # HPUB <subject>  <hdr> <total>
        block = header_block(headers)
        assert line.split()[-2:] == [b"%d" % len(block), b"%d" % (len(block) + 7)]
        assert rest == block + b"payload\r\n"
        assert _frame_with("batch.headers", block, b"payload").endswith(b"\r\n" + rest)
        box = WriteBatch(nc, gap=0.0)
        box.put("batch.headers", b"through the batch", header_block(headers))
        await _until(got, changed, 2)
        assert got == [b"payload", b"through the batch"], (got, seen)
        assert seen[0] == seen[1] == {"Content-Type": "application/msgpack", "Padded": "a  b"}
        with pytest.raises(nats.errors.BadHeaderError):
            header_block({"bad key": "x"})
    finally:
        await nc.close()
        await reader.close()


async def test_a_workers_connection_waits_longer_between_writes_than_an_edges(
    nats_server: NatsServer,
) -> None:
    """A worker's tokens come from many streams, each in a loop turn of its own: its connection
    writes at most every 4 ms while busy. An edge relays what it reads (1 ms). The setting,
    when given, is both's."""
    settings = make_settings(nats_server.url)
    assert settings.nats.write_gap_ms is None
    async with (
        Connection(settings.nats, "worker", source=True) as worker,
        Connection(settings.nats, "edge") as edge,
    ):
        assert (worker.write_batch.gap, edge.write_batch.gap) == (0.004, 0.001)
    given = make_settings(nats_server.url, nats__write_gap_ms=0)
    async with (
        Connection(given.nats, "worker", source=True) as worker,
        Connection(given.nats, "edge") as edge,
    ):
        assert (worker.write_batch.gap, edge.write_batch.gap) == (0.0, 0.0)


async def test_an_answers_last_tokens_leave_in_one_write_with_its_end(
    conn: Connection, settings: MeshSettings
) -> None:
    """Tokens the write batch holds when the answer ends go out with the end, in order, in
    one write to the socket (before: the tokens in one, the end through JetStream in
    another), and the store holds the whole answer."""
    store, publisher, writer = await _answer(conn, settings, "onewrite", timeout=5)
    conn.write_batch.gap = 30.0  # a busy worker's write batch: tokens wait for the gap
    await publisher.send(writer.start())
    await publisher.send(writer.token("a"))
    await conn.nc.flush(timeout=5)
    transport = conn.nc._transport
    assert transport is not None
    writes: list[bytes] = []
    real = transport.writelines

    def counted(payload: list[bytes]) -> None:
        writes.append(b"".join(payload))
        real(payload)

    transport.writelines = counted  # type: ignore[method-assign]
    try:
        for text in ("b", "c", "d"):
            await publisher.send(writer.token(text))  # held: within the gap of the last write
        assert not writes
        assert await publisher.finish(writer.end(finish_reason="stop", usage=Usage()))
    finally:
        transport.writelines = real  # type: ignore[method-assign]
    ended = [w for w in writes if publisher.subject.encode() in w]
    assert len(ended) == 1, f"the last tokens and the end took {len(ended)} writes"
    kept = await store.replay(publisher.subject, timeout=5)
    assert _tokens(kept) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert [e.seq for e in kept if isinstance(e, EndEvent)] == [4]
