"""The cloud worker's answer path at its edges: two requests queued under one id, a request
queued without an id, a worker stopped while it holds a request's last delivery. Each test
failed on the code before its fix (a review of serve.py, takeover.py, worker.py and the rest of
cloud_node).

Workers run in process on the deterministic backend (every answer known exactly) against the
session's real nats-server; requests are published by hand onto the queue subject, as a ``nats``
CLI user does (``nats pub mesh.v1.infer.<model>.<scope> '{...}'``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.provision import provision
from mesh.queue import MSG_ID_HEADER
from protocol.codec import decode_event
from protocol.fingerprint import request_fingerprint
from protocol.messages import (
    EndEvent,
    ErrorEvent,
    InferRequest,
    StartEvent,
    TokenEvent,
    queued_request_id,
)
from protocol.stream import AnswerState
from protocol.subjects import consumer_name, infer_subject, token_subject
from tests.helpers import eventually, holds

MODEL = "smollm2"
SCOPE = "ops"


@pytest.fixture
async def det_worker(settings: MeshSettings, conn: Connection) -> AsyncIterator[Worker]:
    """A worker with four slots on the deterministic backend, 20 ms a token."""
    settings.worker.model.backend = "deterministic"
    settings.worker.model.slots = 4
    settings.worker.model.token_delay_ms = 20.0
    async with Worker(settings, conn, DeterministicBackend(settings.worker.model)) as running:
        yield running


class Collector:
    """Every event published on a token subject (a wildcard allowed), decoded, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    async def on(self, msg: Msg) -> None:
        self.events.append((msg.subject, decode_event(msg.data, msg.headers)))

    def of(self, subject: str) -> list[Any]:
        return [e for s, e in self.events if s == subject]

    def ids(self) -> list[str]:
        seen: list[str] = []
        for _s, event in self.events:
            if event.id not in seen:
                seen.append(event.id)
        return seen


async def no_pulls_waiting(conn: Connection, settings: MeshSettings) -> None:
    """Wait until no pull request is left on the queue's consumer (a stopped worker's expire
    within seconds): a message queued now goes to the next pull, not to one nobody reads."""
    consumer = consumer_name(MODEL)

    async def none_left() -> bool:
        info = await conn.jsm().consumer_info(settings.stream.name, consumer)
        return not info.num_waiting

    await eventually(none_left, timeout=30, what="no pull request left on the consumer")


async def _publish_by_hand(
    conn: Connection, settings: MeshSettings, body: dict[str, Any], msg_id: str | None = None
) -> None:
    """What ``nats pub mesh.v1.infer.smollm2.ops '<json>'`` does (through JetStream, so the
    queue holds it once this returns)."""
    headers = {MSG_ID_HEADER: msg_id} if msg_id else None
    await conn.js.publish(
        infer_subject(MODEL, SCOPE),
        json.dumps(body).encode(),
        stream=settings.stream.name,
        headers=headers,
    )


# -- a request id reused for other content ---------------------------------------------------


async def _det_worker(
    settings: MeshSettings, name: str, *, token_ms: float, slots: int
) -> tuple[Worker, Connection]:
    """A worker of its own (own connection, own node id) on the deterministic backend."""
    own = settings.model_copy(deep=True)
    own.worker.node_id = name
    own.worker.model.backend = "deterministic"
    own.worker.model.slots = slots
    own.worker.model.token_delay_ms = token_ms
    wconn = await Connection(own.nats, name).connect()
    worker = Worker(own, wconn, DeterministicBackend(own.worker.model))
    await worker.start()
    return worker, wconn


async def test_two_queued_requests_under_one_id_never_mix_their_answers(
    conn: Connection, settings: MeshSettings
) -> None:
    """A CLI user (or an SDK caller giving its own ids) queues two different prompts under one
    request id, the second while the first is answered by a slow worker (a CPU pool: 100 ms a
    token); a fast worker (5 ms a token) takes the second. Before, both answers went to the one
    token subject as attempt 1 (a first delivery did not look in the store, so the worker could
    not see the id in use), and the first request's reader (the SDK, which knows its request's
    fingerprint) got the first positions of its own answer, then the second request's tokens
    from where they overtook, then ``incomplete`` (the second's end vouched for another text).
    What should happen (docs/protocol.md, ``duplicate``: "the id is in use by other content of
    the same sender"): the first request's answer whole, the second request one typed
    ``duplicate`` error; never one answer made of two requests' tokens.

    Now: a message queued without the message id senders give (``<scope>.<id>``) may share
    its id, so its worker reads the store first and numbers its attempt above any other. The
    second finds the first's answer under way: it is refused, and its error is not published
    on the token subject the two share while the first streams (the first's readers would take
    it for theirs). A reader of the second (its fingerprint) learns ``duplicate`` from the
    first's start."""
    subject = token_subject(SCOPE, "dup-1")
    seen = Collector()
    await conn.nc.subscribe(subject, cb=seen.on)
    first = {"id": "dup-1", "prompt": "[tag:aa] first", "max_tokens": 40}
    second = {"id": "dup-1", "prompt": "[tag:bb] second", "max_tokens": 40}
    workers = [await _det_worker(settings, "slow", token_ms=100, slots=1)]
    try:
        await _publish_by_hand(conn, settings, first, msg_id="one")
        await eventually(lambda: holds(len(seen.of(subject)) >= 3), what="the first under way")
        workers.append(await _det_worker(settings, "fast", token_ms=5, slots=1))
        await _publish_by_hand(conn, settings, second, msg_id="two")
        fast = workers[1][0]
        await eventually(
            lambda: holds(fast.stats.already_done >= 1),
            timeout=15,
            what="the second request refused",
        )
        await eventually(
            lambda: holds(any(isinstance(e, EndEvent | ErrorEvent) for e in seen.of(subject))),
            timeout=15,
            what="the first request ended",
        )
    finally:
        for worker, wconn in workers:
            await worker.stop()
            await wconn.close()
    # The first request's reader: an SDK that knows what it asked (its fingerprint).
    reader = AnswerState(
        "dup-1", fingerprint=request_fingerprint(InferRequest.model_validate(first))
    )
    for event in seen.of(subject):
        reader.feed(event)
    starts = [(e.attempt, e.node) for e in seen.of(subject) if isinstance(e, StartEvent)]
    outcome = reader.outcome
    assert isinstance(outcome, EndEvent) and reader.text() == Script(tag="aa").answer(40), (
        f"the first request's reader ended in {outcome!r} after the text "
        f"{reader.text()[:160]!r}...; starts on its subject (attempt, worker): {starts}"
    )
    other = AnswerState(
        "dup-1", fingerprint=request_fingerprint(InferRequest.model_validate(second))
    )
    other.feed_all(seen.of(subject))
    assert isinstance(other.outcome, ErrorEvent) and other.outcome.code == "duplicate", (
        other.outcome
    )
    assert [node for _attempt, node in starts] == ["cloud:slow"], starts


# -- a request queued without an id ------------------------------------------------------------


async def test_a_request_queued_without_an_id_keeps_one_id_across_its_deliveries(
    det_worker: Worker, conn: Connection, settings: MeshSettings
) -> None:
    """``nats pub mesh.v1.infer.smollm2.ops '{"prompt": "..."}'`` with ``nats sub
    'mesh.v1.tok.ops.>'``: the request carries no id, and the worker makes one up at each
    delivery (``InferRequest.id``'s default factory runs on every decode). Its engine fails mid
    answer (a retryable error), so the request is handed on: what the user sees is three
    answers under three different ids, two of them cut off after 3 tokens with no end and no
    error ever (silence), the third ending in ``max_deliveries``. What should happen: one id
    for the one queued message (every delivery of it alike), its answer continued or started
    over under that id, ending in exactly one outcome.

    Now: its id is ``queued-<stream sequence>``, the same at every delivery."""
    seen = Collector()
    await conn.nc.subscribe(f"mesh.v1.tok.{SCOPE}.>", cb=seen.on)
    await _publish_by_hand(conn, settings, {"prompt": "[tag:noid] [fail-after:3] hi"})
    await eventually(
        lambda: holds(any(isinstance(e, ErrorEvent | EndEvent) for _s, e in seen.events)),
        timeout=20,
        what="an outcome",
    )
    await asyncio.sleep(0.5)
    ids = seen.ids()
    unended = [
        rid
        for rid in ids
        if not any(isinstance(e, ErrorEvent | EndEvent) and e.id == rid for _s, e in seen.events)
    ]
    assert len(ids) == 1 and not unended, (
        f"one queued request answered under {len(ids)} ids {ids}; "
        f"{len(unended)} of them never ended: {unended}"
    )


# -- a worker stopping on a request's last delivery --------------------------------------------


async def test_a_worker_stopping_mid_answer_on_the_last_delivery_does_not_give_the_request_up(
    conn: Connection, settings: MeshSettings
) -> None:
    """A request already delivered twice (two workers died under it, or a hand pull nak'd it)
    is on its last delivery (``max_deliver`` 3) at worker ``a`` when ``a`` is asked to stop (a
    rolling update). Another worker of the pool has room, so ``a`` hands its answers over: it
    naks the delivery at once (``Worker.stop``: grace 0). JetStream gives a last delivery to
    nobody: the request is given up, and the client gets ``max_deliveries`` ("workers stopped
    mid-request") for an answer that was streaming fine. What should happen: a delivery
    nobody else can take is not handed over; the stopping worker drains it (its
    ``drain_grace``) and the client gets the whole answer.

    Now: a stopping worker hands over only the deliveries below ``max_deliver``; it drains the
    rest."""
    await provision(conn.jsm(), settings.stream, [MODEL])
    await no_pulls_waiting(conn, settings)
    subject = token_subject(SCOPE, "last-1")
    seen = Collector()
    await conn.nc.subscribe(subject, cb=seen.on)
    body = {"id": "last-1", "prompt": "[tag:ld] count", "max_tokens": 40}
    await _publish_by_hand(conn, settings, body, msg_id="last-1")
    # Two deliveries go before: taken and handed back (as by workers that died).
    pull = await conn.js.pull_subscribe_bind(consumer_name(MODEL), settings.stream.name)
    for _ in range(settings.stream.max_deliver - 1):
        (msg,) = await pull.fetch(1, timeout=5)
        await msg.nak()
    await pull.unsubscribe()
    workers = [await _det_worker(settings, "a", token_ms=50, slots=1)]
    try:
        await eventually(
            lambda: holds(any(isinstance(e, TokenEvent) for e in seen.of(subject))),
            what="the last delivery's answer under way at worker a",
        )
        workers.append(await _det_worker(settings, "b", token_ms=5, slots=2))
        await asyncio.sleep(0.3)  # b announced (the registry)
        await workers[0][0].stop()
        await eventually(
            lambda: holds(any(isinstance(e, EndEvent | ErrorEvent) for e in seen.of(subject))),
            timeout=15,
            what="an outcome",
        )
    finally:
        for worker, wconn in workers:
            await worker.stop()
            await wconn.close()
    reader = AnswerState("last-1")
    for event in seen.of(subject):
        reader.feed(event)
    assert isinstance(reader.outcome, EndEvent), (
        f"the request ended in {reader.outcome!r} after {reader.positions} of 40 tokens"
    )
    assert reader.text() == Script(tag="ld").answer(40)


# -- a request queued by hand again, and one without an id in a queue made anew -------------


def _outcomes(seen: Collector, rid: str, since: int = 0) -> list[Any]:
    return [
        e for _s, e in seen.events[since:] if isinstance(e, EndEvent | ErrorEvent) and e.id == rid
    ]


async def test_the_same_request_queued_by_hand_again_is_not_met_with_silence(
    det_worker: Worker,
    conn: Connection,
    settings: MeshSettings,
) -> None:
    """docs/protocol.md's ``nats`` CLI recipe: ``nats sub 'mesh.v1.tok.ops.req-3' &`` then
    ``nats req mesh.v1.infer.smollm2.ops '{"id": "req-3", ...}'`` (no ``Nats-Msg-Id``), run a
    second time. The message may share its id (no ``<scope>.<id>`` message id), so its worker
    reads the store first and finds the first answer done, with the same content: it is
    another message's answer, and this one is answered anew. (It failed on a version that took
    that answer for this message's own, acked it and said nothing on the token subject.)"""
    subject = token_subject(SCOPE, "rep-1")
    body = {"id": "rep-1", "prompt": "[tag:rp] hi", "max_tokens": 5}
    seen = Collector()
    await conn.nc.subscribe(subject, cb=seen.on)
    await _publish_by_hand(conn, settings, body)
    await eventually(lambda: holds(bool(_outcomes(seen, "rep-1"))), what="the first answered")
    mark = len(seen.events)
    await _publish_by_hand(conn, settings, body)  # the same `nats req` again
    with contextlib.suppress(AssertionError):
        await eventually(
            lambda: holds(bool(_outcomes(seen, "rep-1", mark))), timeout=8, what="an outcome"
        )
    stats = det_worker.stats
    assert _outcomes(seen, "rep-1", mark), (
        f"queued again by hand: no event on {subject} in 8 s "
        f"(events since: {seen.events[mark:]}; already_done={stats.already_done})"
    )


async def test_a_request_queued_without_an_id_into_a_queue_made_anew_is_not_a_duplicate(
    det_worker: Worker,
    conn: Connection,
    settings: MeshSettings,
) -> None:
    """``queued-<stream seq>`` is unique only within one life of the queue stream. Made anew
    (``nats stream rm MESH_INFER``, then provisioned), its sequences start over at 1 while the
    answer store (two minutes) still holds ``queued-1``'s answer. The next request queued
    without an id is ``queued-1`` again, and must get its own answer: a finished answer under a
    derived id on a first delivery is another message's. (It failed on a version that refused
    it ``duplicate``: the user gave no id, and could send nothing that fixes it.)"""
    seen = Collector()
    await conn.nc.subscribe(f"mesh.v1.tok.{SCOPE}.>", cb=seen.on)
    queue = infer_subject(MODEL, SCOPE)

    async def queue_without_id(tag: str) -> int:
        body = {"prompt": f"[tag:{tag}] hi", "max_tokens": 5}
        ack = await conn.js.publish(queue, json.dumps(body).encode(), stream=settings.stream.name)
        return int(ack.seq)

    first = await queue_without_id("qa")
    rid = queued_request_id(first)
    await eventually(lambda: holds(bool(_outcomes(seen, rid))), what="the first answered")
    await conn.jsm().delete_stream(settings.stream.name)  # the queue made anew
    await provision(conn.jsm(), settings.stream, [MODEL])
    mark = len(seen.events)
    second = await queue_without_id("qb")
    assert second == first  # the sequences started over
    await eventually(
        lambda: holds(bool(_outcomes(seen, rid, mark))), timeout=20, what="the second's outcome"
    )
    outcome = _outcomes(seen, rid, mark)[0]
    assert isinstance(outcome, EndEvent), (
        f"a request queued without an id, after the queue was made anew: {outcome!r}"
    )
