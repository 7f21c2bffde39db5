"""Tokens passed on from the subscription's callback (an edge's relay to NATS clients): exactly
what the plain way passes on, in order, around a gap and its repair.

Real nats-server; the events are published on a plain connection as a worker publishes them.
"""

from __future__ import annotations

import asyncio

import nats

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.reader import AnswerReader
from protocol.codec import WireFormat, dump_event
from protocol.messages import EndEvent, TokenEvent, Usage, WireEvent, token_event
from protocol.stream import AnswerState, AnswerWriter

SUBJECT = "mesh.v1.tok.pass.r1"


class _Collect:
    def __init__(self) -> None:
        self.taken: list[TokenEvent] = []
        self.now = True

    def ready(self) -> bool:
        return self.now

    def take(self, tokens: list[TokenEvent]) -> None:
        self.taken.extend(tokens)

    def take_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        self.taken.append(token_event("r1", seq, text, attempt, n))


def _answer() -> list[WireEvent]:
    writer = AnswerWriter("r1", attempt=1, node="cloud:w1")
    events: list[WireEvent] = [writer.start()]
    events += [writer.token(f"t{i} ") for i in range(8)]
    events.append(writer.end(finish_reason="stop", usage=Usage(completion_tokens=8)))
    return events


async def _read_all(reader: AnswerReader, passer: _Collect) -> list[WireEvent]:
    """What goes on, in order: each batch next() returns, with what the callback passed on
    before it (the relay's order)."""
    out: list[WireEvent] = []
    seen = 0
    while not reader.state.done:
        batch = await reader.next(0.2)
        out += passer.taken[seen:]
        seen = len(passer.taken)
        out += batch
    return out


async def _stream(
    server: NatsServer, reader: AnswerReader, passer: _Collect, events: list[WireEvent]
) -> list[WireEvent]:
    """Publish ``events`` one at a time, as a worker streams, while the reader reads; what
    went on, in order."""
    reader.pass_tokens(passer)
    await reader.subscribe(SUBJECT)
    await reader.conn.nc.flush()
    worker = await nats.connect(server.url)
    try:
        reading = asyncio.create_task(_read_all(reader, passer))
        for event in events:
            await worker.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
            await worker.flush()
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(reading, 10)
    finally:
        await worker.close()
        await reader.close()


async def test_passed_tokens_and_the_rest_make_one_whole_answer_in_order(
    nats_server: NatsServer, conn: Connection
) -> None:
    answer = _answer()
    lost = answer[4]  # token t3 never reaches the reader: a gap, then a repair
    repairs: list[int] = []

    async def repair(_state: AnswerState) -> list[WireEvent]:
        repairs.append(len(repairs))
        return answer  # what the store kept: everything

    reader = AnswerReader(conn, AnswerState("r1"), repair, what="the cloud")
    passer = _Collect()
    out = await _stream(nats_server, reader, passer, [e for e in answer if e is not lost])
    assert [(type(e).__name__, getattr(e, "seq", None)) for e in out] == [
        (type(e).__name__, getattr(e, "seq", None)) for e in answer
    ]
    assert "".join(e.text for e in out if isinstance(e, TokenEvent)) == "".join(
        f"t{i} " for i in range(8)
    )
    assert isinstance(out[-1], EndEvent)
    assert passer.taken, "no token went on from the callback"
    assert repairs, "the gap was not repaired"


async def test_a_client_that_cannot_take_tokens_now_gets_them_the_plain_way(
    nats_server: NatsServer, conn: Connection
) -> None:
    answer = _answer()
    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud")
    passer = _Collect()
    passer.now = False  # an SSE stream among the clients
    out = await _stream(nats_server, reader, passer, answer)
    assert passer.taken == [] and reader.passed == 0
    assert [getattr(e, "seq", None) for e in out] == [getattr(e, "seq", None) for e in answer]


async def test_with_a_passer_the_caller_hears_of_a_check_on_the_worker_at_once(
    nats_server: NatsServer, conn: Connection
) -> None:
    """Tokens passed on do not wake the caller, so after the answer goes quiet and the reader
    checks on its worker, next() returns then, not at the end of the caller's wait: an edge
    falls back as soon as the check says the worker is gone."""
    answer = _answer()
    checked = asyncio.Event()

    async def watch(_state: AnswerState) -> None:
        checked.set()

    reader = AnswerReader(conn, AnswerState("r1"), None, what="the cloud", watch=watch)
    passer = _Collect()
    reader.pass_tokens(passer)
    await reader.subscribe(SUBJECT)
    await conn.nc.flush()
    worker = await nats.connect(nats_server.url)
    try:
        await worker.publish(SUBJECT, dump_event(answer[0], WireFormat.MSGPACK))
        await worker.flush()
        assert await reader.next(5) == [answer[0]]  # the start, the usual way
        for event in answer[1:4]:
            await worker.publish(SUBJECT, dump_event(event, WireFormat.MSGPACK))
        await worker.flush()  # then nothing: the worker is gone

        async def until_quiet() -> list[WireEvent]:
            got: list[WireEvent] = []
            while out := await reader.next(30):
                got += out
            return got

        got = await asyncio.wait_for(until_quiet(), 10)  # not the 30 s each wait was given
        assert checked.is_set()
        assert [e.seq for e in [*passer.taken, *got]] == [0, 1, 2]
    finally:
        await worker.close()
        await reader.close()
