"""Requests queued by hand (``nats pub`` into the queue, no ``<scope>.<id>`` message id) that
share an id with another message: the same request queued again after its first delivery was
handed back, and a third message's ``duplicate`` while another answer under the id streams.
Each failed on the code before its fix (review S16x)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from nats.aio.msg import Msg

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from protocol.codec import decode_event
from protocol.messages import EndEvent, ErrorEvent, StartEvent
from protocol.subjects import consumer_name, infer_subject, token_subject
from tests.helpers import eventually, holds
from tests.test_worker_answer_edges import no_pulls_waiting

MODEL = "smollm2"
SCOPE = "ops"


class Collector:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def on(self, msg: Msg) -> None:
        self.events.append((msg.subject, decode_event(msg.data, msg.headers)))


def _outcomes(seen: Collector, rid: str, since: int = 0) -> list[Any]:
    return [
        e for _s, e in seen.events[since:] if isinstance(e, EndEvent | ErrorEvent) and e.id == rid
    ]


async def _det_worker(
    settings: MeshSettings, name: str, token_ms: float = 5.0
) -> tuple[Worker, Connection]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = name
    own.worker.model.backend = "deterministic"
    own.worker.model.slots = 2
    own.worker.model.token_delay_ms = token_ms
    wconn = await Connection(own.nats, name).connect()
    worker = Worker(own, wconn, DeterministicBackend(own.worker.model))
    await worker.start()
    return worker, wconn


async def _stop(running: tuple[Worker, Connection]) -> None:
    worker, wconn = running
    await worker.stop()
    await wconn.close()


# -- 1. a hand-queued request again, whose first delivery was handed back before it wrote ----


async def test_the_same_request_queued_by_hand_again_is_answered_after_a_handed_back_delivery(
    conn: Connection, settings: MeshSettings
) -> None:
    """docs/protocol.md's CLI recipe run twice (``nats req`` with the same body, no message
    id). The second message's first delivery goes to a worker that hands it back before it
    writes anything (it stopped with a peer that had room, was cut short in its store look, or
    died): that is an ordinary fault. The redelivery (attempt 2) finds the FIRST message's
    finished answer with the same content. Expected: an answer of its own (as on an
    undisturbed first delivery). Before its fix the worker answered anew on attempt 1 only,
    took the other message's answer for this one's own, acked it and published nothing: the
    second client (``nats sub`` on the token subject) heard silence for ever. Now the
    answer's start names its delivery, and only this message's own answer is made final."""
    rid = "rep-x"
    subject = token_subject(SCOPE, rid)
    body = {"id": rid, "prompt": "[tag:rx] hi", "max_tokens": 5}
    seen = Collector()
    await conn.nc.subscribe(subject, cb=seen.on)
    queue = infer_subject(MODEL, SCOPE)
    first = await _det_worker(settings, "w1")
    try:
        await conn.js.publish(queue, json.dumps(body).encode(), stream=settings.stream.name)
        await eventually(lambda: holds(bool(_outcomes(seen, rid))), what="the first answered")
    finally:
        await _stop(first)
    await no_pulls_waiting(conn, settings)  # the first worker's pulls: gone with it
    mark = len(seen.events)
    await conn.js.publish(queue, json.dumps(body).encode(), stream=settings.stream.name)
    # Its first delivery: taken and handed back before a start was written.
    pull = await conn.js.pull_subscribe_bind(consumer_name(MODEL), settings.stream.name)
    (msg,) = await pull.fetch(1, timeout=5)
    await msg.nak()
    await pull.unsubscribe()
    second = await _det_worker(settings, "w2")
    try:
        with contextlib.suppress(AssertionError):
            await eventually(
                lambda: holds(bool(_outcomes(seen, rid, mark))), timeout=8, what="an outcome"
            )
        stats = second[0].stats
    finally:
        await _stop(second)
    assert _outcomes(seen, rid, mark), (
        f"queued by hand again, its first delivery handed back: nothing on {subject} in 8 s "
        f"(events since: {seen.events[mark:]}; already_done={stats.already_done})"
    )


# -- 2. the edge: models outside its registry pool -------------------------------------------


# -- 4. a duplicate refused while a request queued anew under its id streams ----------------


async def test_a_duplicate_is_not_said_on_the_subject_while_another_answer_under_its_id_streams(
    conn: Connection, settings: MeshSettings
) -> None:
    """W (``nats req``, id ``dx``, content C) was answered. The same ``nats req`` is run again
    (Y, content C): it is answered anew, and it streams. Meanwhile a third message Z under
    ``dx`` with other content D is queued by hand: refused ``duplicate``, its error published
    on the shared token subject only once the answer there has ended. Expected: Y's reader ends
    in Y's whole answer, nothing else. Before its fix any end stored under the subject counted
    (W's), so the error (no attempt number: every reader applies it) landed in the middle of
    Y's live answer; now only an end after the last start does."""
    rid = "dx"
    subject = token_subject(SCOPE, rid)
    c_body = {"id": rid, "prompt": "[tag:dc] same", "max_tokens": 5}
    d_body = {"id": rid, "prompt": "[tag:dd] other", "max_tokens": 5}
    seen = Collector()
    await conn.nc.subscribe(subject, cb=seen.on)
    queue = infer_subject(MODEL, SCOPE)
    running = await _det_worker(settings, "w3", token_ms=300.0)
    try:
        await conn.js.publish(queue, json.dumps(c_body).encode(), stream=settings.stream.name)
        await eventually(lambda: holds(bool(_outcomes(seen, rid))), timeout=15, what="W answered")
        mark = len(seen.events)
        await conn.js.publish(queue, json.dumps(c_body).encode(), stream=settings.stream.name)
        await eventually(
            lambda: holds(any(isinstance(e, StartEvent) for _s, e in seen.events[mark:])),
            what="Y answered anew, under way",
        )
        await conn.js.publish(queue, json.dumps(d_body).encode(), stream=settings.stream.name)
        await eventually(
            lambda: holds(any(isinstance(e, EndEvent) for _s, e in seen.events[mark:])),
            timeout=15,
            what="Y's end",
        )
        await asyncio.sleep(0.5)
    finally:
        await _stop(running)
    y_events = [e for _s, e in seen.events[mark:]]
    kinds = [
        type(e).__name__ + (f"({e.code})" if isinstance(e, ErrorEvent) else "") for e in y_events
    ]
    end_at = next(i for i, e in enumerate(y_events) if isinstance(e, EndEvent))
    early = [e for e in y_events[:end_at] if isinstance(e, ErrorEvent)]
    assert not early, (
        f"an error on {subject} in the middle of Y's live answer (what Y's client reads): {kinds}"
    )
