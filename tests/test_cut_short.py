"""A delivery cut short before its generation holds it: the worker is still looking in the
store (what an earlier attempt left, a request that can wait: its lease and history) or asking
whether the message predates its consumer, when a shutdown or a client's cancel cancels it.

Its generation would have settled the message whatever ended it. Before that, nothing did: the
message sat unacked until ``ack_wait`` (10 s here), so a worker handing its requests over left
this one's client waiting that long, and a cancelled one got its ``cancelled`` only from the
redelivery. Now a shutdown hands it back at once and a cancel answers it at once.

Real nats-server and in-process workers. The store look is held open by the test (a look the
store answers slowly); everything else is as served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.reader import AnswerReader
from protocol.messages import EndEvent, ErrorEvent
from protocol.stream import AnswerState
from protocol.subjects import cancel_subject, infer_subject, token_subject
from tests.helpers import eventually, queue_drained

MODEL = "cutshort"
SCOPE = "site-c"
TOKENS = 12
EXPECTED = "".join(f" q{i}" for i in range(TOKENS))
PROMPT = "[tag:q] go"
SOON = 3.0  # well short of ack_wait (10 s): what the old wait cost


def _backend() -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", name=MODEL, slots=2, token_delay_ms=5)
    )


@contextlib.asynccontextmanager
async def _worker(settings: MeshSettings, name: str) -> AsyncIterator[Worker]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = name
    own.worker.drain_grace = 0.2
    async with Connection(own.nats, name) as conn, Worker(own, conn, _backend()) as worker:
        yield worker


def _hold(target: Any, name: str) -> asyncio.Event:
    """Make ``target.name`` (an async look) wait until the test is done with it: a store that
    answers slowly. Returns the event set once the look has begun."""
    looking = asyncio.Event()
    forever = asyncio.Event()

    async def held(*_args: Any, **_kwargs: Any) -> Any:
        looking.set()
        await forever.wait()

    setattr(target, name, held)
    return looking


async def _queue(conn: Connection, settings: MeshSettings, rid: str, deferrable: bool) -> None:
    body = {"id": rid, "prompt": PROMPT, "max_tokens": TOKENS, "deferrable": deferrable}
    await conn.js.publish(
        infer_subject(MODEL, SCOPE),
        json.dumps(body).encode(),
        stream=settings.stream.name,
        headers={"Nats-Msg-Id": f"{SCOPE}.{rid}"},
    )


async def _read(conn: Connection, rid: str) -> AnswerReader:
    reader = AnswerReader(conn, AnswerState(rid), None, what="the cloud")
    await reader.subscribe(token_subject(SCOPE, rid))
    return reader


async def _until_done(reader: AnswerReader, timeout: float) -> float:
    """Read until the answer ends; the seconds it took."""
    began = time.monotonic()
    while not reader.state.done and time.monotonic() - began < timeout:
        await reader.next(0.2)
    return time.monotonic() - began


LOOKS: dict[str, tuple[bool, Callable[[Worker], tuple[Any, str]]]] = {
    # a request that can wait reads the store on its first delivery: inside its serving
    "store look": (True, lambda worker: (worker.handler.takeover, "read")),
    # every delivery asks whether it predates its consumer: before its serving began
    "epoch look": (False, lambda worker: (worker.handler.epoch, "predates")),
}


@pytest.mark.parametrize("look", list(LOOKS))
async def test_a_worker_stopping_during_a_look_hands_the_delivery_back_at_once(
    settings: MeshSettings, conn: Connection, look: str
) -> None:
    deferrable, where = LOOKS[look]
    rid = f"cut-stop-{deferrable}"
    async with _worker(settings, "looker") as first:
        looking = _hold(*where(first))
        reader = await _read(conn, rid)
        await _queue(conn, settings, rid, deferrable)
        await asyncio.wait_for(looking.wait(), 10)
        async with _worker(settings, "taker"):  # the one it should go to now
            await first.stop()
            took = await _until_done(reader, 15)
            outcome = reader.state.outcome
            await reader.close()
            assert isinstance(outcome, EndEvent), f"ended with {outcome!r}"
            assert reader.state.text() == EXPECTED
            assert took < SOON, f"answered {took:.2f}s after the stop (ack_wait is 10 s)"
            await eventually(lambda: queue_drained(conn, settings, MODEL), 10, "queue drained")


async def test_a_cancel_during_a_store_look_answers_it_at_once(
    settings: MeshSettings, conn: Connection
) -> None:
    rid = "cut-cancel"
    async with _worker(settings, "looker") as worker:
        looking = _hold(worker.handler.takeover, "read")
        reader = await _read(conn, rid)
        await _queue(conn, settings, rid, True)
        await asyncio.wait_for(looking.wait(), 10)
        assert token_subject(SCOPE, rid) in worker.handler.inflight
        await conn.nc.publish(cancel_subject(SCOPE, rid), b"")
        took = await _until_done(reader, 15)
        outcome = reader.state.outcome
        await reader.close()
        assert isinstance(outcome, ErrorEvent), f"ended with {outcome!r}"
        assert outcome.code == "cancelled"
        assert took < SOON, f"told {took:.2f}s after the cancel (ack_wait is 10 s)"
        await eventually(
            lambda: queue_drained(conn, settings, MODEL), SOON, "the cancelled request gone"
        )
        assert worker.handler.inflight == {}
