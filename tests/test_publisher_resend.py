"""A worker publishes again what a reader lacks at most every RESEND_GAP_S; an ask that comes
within that gap is published at its end, once for every reader that asked.

Before, such an ask got nothing: the reader whose store read had failed waited for its next
failed read (0.2 s or more) to ask again, and that ask could fall within the gap as well.
Real nats-server, a real publisher; a raw subscriber on the answer's subject stands for the
readers.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog
from nats.aio.msg import Msg

from cloud_node.publisher import RESEND_GAP_S, AnswerPublisher
from mesh.answer_store import AnswerStore, ensure_answer_stream
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.logs import merge_bound
from protocol.codec import WireFormat, decode_event
from protocol.messages import TokenEvent
from protocol.stream import AnswerWriter
from tests.helpers import eventually


async def _three_tokens(conn: Connection, settings: MeshSettings) -> AnswerPublisher:
    """A worker's publisher (on ``conn``) that has published a start and tokens "a", "b", "c"
    (0 to 2)."""
    await ensure_answer_stream(conn.jsm(), settings.stream)
    store = AnswerStore(conn, settings.stream, filtered=False)
    publisher = AnswerPublisher(conn, store, "resend", "req-1", WireFormat.MSGPACK, timeout=5)
    writer = AnswerWriter("req-1", attempt=1, node="cloud:test")
    await publisher.send(writer.start())
    for text in "abc":
        await publisher.send(writer.token(text))
    assert await conn.write_batch.flush()
    return publisher


async def _listen(conn: Connection, subject: str) -> list[tuple[float, int]]:
    """(when, position) of every token published on ``subject`` from now on."""
    got: list[tuple[float, int]] = []

    async def on_msg(msg: Msg) -> None:
        event = decode_event(msg.data, msg.headers)
        if isinstance(event, TokenEvent):
            got.append((time.monotonic(), event.seq))

    await conn.nc.subscribe(subject, cb=on_msg)
    await conn.nc.flush(timeout=5)
    return got


async def test_an_ask_within_the_gap_is_answered_at_its_end(
    conn: Connection, settings: MeshSettings
) -> None:
    publisher = await _three_tokens(conn, settings)
    got = await _listen(conn, publisher.subject)
    asked = time.monotonic()
    assert await publisher.resend(1, 2) == 1  # one reader lacks "c": published at once
    # Another reader lacks "a" and "b" and holds "c": within the gap, so not at once...
    assert await publisher.resend(1, 0, upto=2) == 0

    async def has_a() -> bool:
        return any(seq == 0 for _at, seq in got)

    # ...but at the gap's end, without being asked again.
    await eventually(has_a, timeout=2 * RESEND_GAP_S + 1, what='"a" published again')
    when_a = next(at for at, seq in got if seq == 0)
    assert when_a - asked >= RESEND_GAP_S * 0.9, "published again within the gap"
    await asyncio.sleep(RESEND_GAP_S / 2)
    assert sorted(seq for _at, seq in got) == [0, 1, 2], got


async def test_many_asks_within_the_gap_are_published_once(
    conn: Connection, settings: MeshSettings
) -> None:
    """Review S20a's flood stays answered once: 50 readers' asks within the gap, each lacking
    a different part, make one resend of everything they lack between them."""
    publisher = await _three_tokens(conn, settings)
    got = await _listen(conn, publisher.subject)
    assert await publisher.resend(1, 3) == 0  # lacks nothing: no resend, and no gap begun
    assert await publisher.resend(1, 2) == 1
    for n in range(50):
        assert await publisher.resend(1, n % 2, upto=1 + n % 2) == 0

    async def two_more() -> bool:
        return len(got) >= 3

    await eventually(two_more, timeout=2 * RESEND_GAP_S + 1, what="the asks' resend")
    await asyncio.sleep(RESEND_GAP_S * 1.5)  # a second resend would come by now
    assert sorted(seq for _at, seq in got) == [0, 1, 2], got


@pytest.mark.parametrize("attempt", [2, 1])
async def test_an_ask_within_the_gap_for_nothing_this_worker_lacks_sends_nothing(
    conn: Connection, settings: MeshSettings, attempt: int
) -> None:
    """An ask for a newer attempt (another worker's) or for nothing missing is not kept."""
    publisher = await _three_tokens(conn, settings)
    got = await _listen(conn, publisher.subject)
    assert await publisher.resend(1, 2) == 1
    assert await publisher.resend(attempt, 3) == 0
    await asyncio.sleep(RESEND_GAP_S * 2)
    assert [seq for _at, seq in got] == [2]


async def test_a_kept_ask_is_dropped_once_the_worker_lets_the_answer_go(
    conn: Connection, settings: MeshSettings
) -> None:
    """Handed back, lost, superseded or settled (``forget``): what was asked within the gap is
    not published at its end. A resend of the old attempt then could carry a reader that has
    not seen the next attempt's start past where that attempt resumes (review S26a)."""
    publisher = await _three_tokens(conn, settings)
    got = await _listen(conn, publisher.subject)
    assert await publisher.resend(1, 2) == 1
    assert await publisher.resend(1, 0, upto=2) == 0
    publisher.forget()
    await asyncio.sleep(RESEND_GAP_S * 2)
    assert [seq for _at, seq in got] == [2]


async def test_a_kept_ask_after_the_connection_closed_logs_no_failure(
    conn: Connection, settings: MeshSettings
) -> None:
    """Review S26a: a worker asked within the gap, then stopped and closed its connection (as
    the CLI does right after ``Worker.stop``): the kept ask fired on the closed connection and
    logged "background task failed" at ERROR, with a traceback, on such a shutdown."""
    own = await Connection(settings.nats, "worker-s26a").connect()
    publisher = await _three_tokens(own, settings)
    with structlog.testing.capture_logs([merge_bound]) as logs:
        assert await publisher.resend(1, 2) == 1
        assert await publisher.resend(1, 0, upto=2) == 0  # kept for the gap's end
        await own.close()
        await asyncio.sleep(RESEND_GAP_S * 2)
    failed = [e for e in logs if e.get("log_level") in ("error", "critical")]
    assert not failed, failed
