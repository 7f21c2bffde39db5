"""The progress-lapse rule (cloud_node/progress.py, cloud_node/serve.py) when the alarm is
false: a worker whose event loop stood still for most of ack_wait (a loaded box, a backend that
blocks the loop for a moment) takes its delivery for lost, though JetStream never redelivered
it. Real nats-server, an in-process worker; the stall is the loop blocked (time.sleep) at the
start of generation, 0.85 x ack_wait: past the 0.8 x ack_wait lapse, short of ack_wait (the
progress report that follows reaches the server in time, so nothing is redelivered).

A false alarm costs at most one extra delivery, which finds the answer stored and settles it.
On the last delivery (attempt == max_deliver) nobody else can hold the request, so the worker
settles it itself: left unsettled, the consumer would give up on it (the MAX_DELIVERIES
advisory) and the request would end in that error instead of its own outcome."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest

from cloud_node.worker import Worker
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.reader import AnswerReader
from protocol.codec import decode_event
from protocol.errors import BackendError
from protocol.messages import Answer, EndEvent, ErrorEvent, InferRequest
from protocol.stream import AnswerState
from protocol.subjects import ANSWERS_STREAM, answer_subject, infer_subject, token_subject
from tests.helpers import eventually, queue_drained

MODEL = "lapse"
SCOPE = "site-l"
TOKENS = 20
ACK_WAIT = 4.0
STALL = 0.85 * ACK_WAIT  # past the lapse (0.8), 0.6 s short of ack_wait
EXPECTED = "".join(f" q{i}" for i in range(TOKENS))


class _Stalling(DeterministicBackend):
    """Blocks the event loop once, at the start of its first generation; optionally fails
    for good (not retryable) after ``fail_after`` tokens."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__(
            ModelSettings(backend="deterministic", name=MODEL, slots=2, token_delay_ms=20)
        )
        self.stalled = False
        self.fail_after = fail_after

    async def generate(  # type: ignore[override]
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncIterator[Chunk]:
        if not self.stalled:
            self.stalled = True
            time.sleep(STALL)  # noqa: ASYNC251 - the whole worker stands still, on purpose
        n = 0
        async with contextlib.aclosing(
            super().generate(request, prefix=prefix, prefix_tokens=prefix_tokens)
        ) as chunks:
            async for chunk in chunks:
                if self.fail_after is not None and n >= self.fail_after:
                    raise BackendError("the prompt does not fit (scripted)", retryable=False)
                n += 1
                yield chunk


@contextlib.asynccontextmanager
async def _worker(
    settings: MeshSettings, conn: Connection, backend: DeterministicBackend
) -> AsyncIterator[Worker]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = "lapser"
    async with Worker(own, conn, backend) as running:
        yield running


async def _queue(conn: Connection, settings: MeshSettings, rid: str, *, deferrable: bool) -> None:
    body = {"id": rid, "prompt": "[tag:q] go", "max_tokens": TOKENS, "deferrable": deferrable}
    await conn.js.publish(
        infer_subject(MODEL, SCOPE),
        json.dumps(body).encode(),
        stream=settings.stream.name,
        headers={"Nats-Msg-Id": f"{SCOPE}.{rid}"},
    )


async def _kept(conn: Connection, rid: str) -> object:
    try:
        msg = await conn.jsm().get_msg(
            ANSWERS_STREAM, subject=answer_subject(SCOPE, rid), direct=True
        )
    except Exception:
        return None
    return decode_event(msg.data or b"")


async def _read(conn: Connection, rid: str) -> AnswerReader:
    reader = AnswerReader(conn, AnswerState(rid), None, what="the cloud")
    await reader.subscribe(token_subject(SCOPE, rid))
    return reader


async def _until_done(reader: AnswerReader, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not reader.state.done and time.monotonic() < end:
        await reader.next(0.5)


@pytest.mark.parametrize("max_deliver", [1, 3])
async def test_a_false_lapse_keeps_the_whole_answer_of_a_request_that_can_wait(
    settings: MeshSettings, conn: Connection, max_deliver: int
) -> None:
    """The worker stalls 0.85 x ack_wait, generates the whole answer, and (lapsed) neither
    keeps nor acks it. With deliveries left, the next one finds it done and keeps it (the
    designed cost). On the last delivery, nobody else can hold the request, yet it is left
    unsettled: the consumer gives up and the MAX_DELIVERIES handler keeps a max_deliveries
    error for an answer that was generated and stored whole."""
    settings.stream.ack_wait = ACK_WAIT
    settings.stream.max_deliver = max_deliver
    rid = f"lapse-kept-{max_deliver}"
    backend = _Stalling()
    async with _worker(settings, conn, backend) as worker:
        reader = await _read(conn, rid)
        await _queue(conn, settings, rid, deferrable=True)
        await _until_done(reader, 20)
        assert isinstance(reader.state.outcome, EndEvent)  # the live reader got it all
        await eventually(lambda: queue_drained(conn, settings, MODEL), 20, "queue drained")
        await asyncio.sleep(0.5)
        kept = await _kept(conn, rid)
        await reader.close()
        assert backend.started == 1, "the answer was generated once"
        assert worker.stats.max_deliveries == 0, "not answered as out of deliveries"
        assert isinstance(kept, Answer), f"kept {kept!r}, not the answer"
        assert kept.text == EXPECTED


async def test_a_false_lapse_on_the_last_delivery_keeps_the_real_error(
    settings: MeshSettings, conn: Connection
) -> None:
    """The engine fails for good (not retryable) after the stall, on the only delivery: the
    client should get that typed error, at once; lapsed, the worker publishes nothing and the
    client waits ack_wait for a max_deliveries error instead."""
    settings.stream.ack_wait = ACK_WAIT
    settings.stream.max_deliver = 1
    rid = "lapse-err-1"
    backend = _Stalling(fail_after=5)
    async with _worker(settings, conn, backend):
        reader = await _read(conn, rid)
        await _queue(conn, settings, rid, deferrable=False)
        await _until_done(reader, 20)
        outcome = reader.state.outcome
        await reader.close()
        assert isinstance(outcome, ErrorEvent)
        assert outcome.code == "backend_error", f"got {outcome.code}: {outcome.message}"
