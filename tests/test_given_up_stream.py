"""Requests JetStream gave up on, read from the hub's stream ``MESH_GIVEN_UP``
(:mod:`cloud_node.given_up`): ended when no worker listened as the advisory came, without a
free slot, and without holding one while the hub refuses a keep. Review S20d found the first
form of the fix (the consumer delivering without limit, a delivery past ``max_deliver`` ended by
the worker that got it) took every slot of the pool for one request whose keep waited, and
ended a request only once a slot freed; those two tests failed on it. Real nats-server,
in-process workers on the deterministic backend."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

from nats.js import api

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.provision import consumer_config
from protocol.codec import CONTENT_TYPE, WireFormat, dump
from protocol.fingerprint import request_fingerprint
from protocol.messages import EndEvent, ErrorEvent, InferRequest
from protocol.subjects import (
    ANSWERS_STREAM,
    answer_subject,
    consumer_name,
    infer_subject,
    token_subject,
)
from tests.helpers import eventually, queue_drained
from tests.test_deferred_outcomes import MODEL, _kept_soon, _queue, _worker


def _backend(slots: int = 2, token_delay_ms: int = 5) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(
            backend="deterministic", name=MODEL, slots=slots, token_delay_ms=token_delay_ms
        )
    )


def _scope() -> str:
    return f"s20d-{uuid.uuid4().hex[:8]}"


async def _answered(worker: Worker, scope: str, rid: str) -> bool:
    events = await worker.store.replay(token_subject(scope, rid))
    return any(isinstance(e, EndEvent) for e in events)


async def _dies_with_it(conn: Connection, settings: MeshSettings) -> None:
    """A worker that takes the next delivery and dies with it (never acks)."""
    dying = await conn.js.pull_subscribe_bind(consumer_name(MODEL), settings.stream.name)
    taken = await dying.fetch(1, timeout=5)
    assert len(taken) == 1
    await dying.unsubscribe()


# Before the fix (heal; the first form, aeef0bc): a request that can wait, given up on, was
# ended by the worker that got its next delivery, keeping its outcome "patiently": while the hub
# refused the keep it retried for as long as the worker ran, holding the delivery's slot, and
# JetStream (max_deliver -1) handed the message to the next free slot every ack_wait: one
# request took every slot of the pool. Read from the stream, the keep is tried once and the
# advisory handed back; no slot is taken.
async def test_a_request_given_up_on_whose_keep_waits_does_not_take_the_pools_slots(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.stream.max_deliver = 1
    settings.stream.ack_wait = 1.0
    settings.worker.drain_grace = 0.5
    scope, rid = _scope(), "gone-1"
    body = {"id": rid, "prompt": "[tag:q] x", "max_tokens": 5, "deferrable": True}
    async with _worker(settings, conn, "s20d-before", _backend()):
        pass  # provisions the queue, its consumer and MESH_ANSWERS
    info = await conn.jsm().stream_info(ANSWERS_STREAM)
    config = info.config
    await _queue(conn, settings, scope, body, f"{scope}.{rid}")
    await _dies_with_it(conn, settings)
    # The hub refuses to keep answers for a while (a stand-in for MESH_ANSWERS without a leader).
    refusing = api.StreamConfig.from_response(config.as_dict())
    refusing.max_msg_size = 16
    await conn.jsm().update_stream(refusing)
    try:
        async with _worker(settings, conn, "s20d-after", _backend(slots=2)) as worker:
            await asyncio.sleep(2.5)  # the hub has refused keeps for 2.5 s (2.5 ack_waits)
            live, other = "live-1", _scope()
            await _queue(
                conn,
                settings,
                other,
                {"id": live, "prompt": "[tag:z] y", "max_tokens": 5},
                f"{other}.{live}",
            )
            fetched = worker.stats.fetched
            answered = False
            with contextlib.suppress(AssertionError):
                await eventually(lambda: _answered(worker, other, live), 3, "served")
                answered = True
            assert answered, (
                f"an interactive request waits: the worker's slots are held by {fetched} "
                "deliveries of one request given up on"
            )
    finally:
        await conn.jsm().update_stream(api.StreamConfig.from_response(config.as_dict()))


# A request given up on under the consumer an older worker provisioned, while no worker
# listened, is ended once a worker of the pool comes: the stream kept the advisory. (Left open:
# one given up on before the stream existed; its advisory is gone.)
async def test_a_request_given_up_on_before_the_upgrade_is_ended_after_it(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.stream.max_deliver = 1
    settings.stream.ack_wait = 1.0
    scope, rid = _scope(), "old-1"
    body = {"id": rid, "prompt": "[tag:q] x", "max_tokens": 5, "deferrable": True}
    async with _worker(settings, conn, "s20d-new0", _backend()):
        pass  # provisions the queue and MESH_ANSWERS
    # The consumer as an older worker provisioned it: JetStream gives up after max_deliver.
    old = consumer_config(settings.stream, MODEL)
    old.max_deliver = settings.stream.max_deliver
    await conn.jsm().add_consumer(settings.stream.name, old)
    told: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def heard(_msg: object) -> None:
        if not told.done():
            told.set_result(None)

    advisory = await conn.nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{settings.stream.name}.{consumer_name(MODEL)}",
        cb=heard,
    )
    await _queue(conn, settings, scope, body, f"{scope}.{rid}")
    await _dies_with_it(conn, settings)  # the last delivery's worker dies; none listens
    puller = await conn.js.pull_subscribe_bind(consumer_name(MODEL), settings.stream.name)
    with contextlib.suppress(Exception):
        await puller.fetch(1, timeout=2.5)
    await puller.unsubscribe()
    await asyncio.wait_for(told, 3)  # JetStream gave up on it, and no worker heard
    await advisory.unsubscribe()
    info = await conn.jsm().stream_info(settings.stream.name)
    assert info.state.messages == 1
    async with _worker(settings, conn, "s20d-new", _backend()):  # the upgraded pool starts
        kept = await _kept_soon(conn, scope, rid, timeout=3.0)
        left = (await conn.jsm().stream_info(settings.stream.name)).state.messages
    assert kept is not None, f"nothing kept; the request is still queued ({left}), for ever"


async def _told(worker: Worker, scope: str, rid: str) -> list[str]:
    events = await worker.store.replay(token_subject(scope, rid))
    return [e.code for e in events if isinstance(e, ErrorEvent)]


# Before the fix (heal; the first form, aeef0bc): a request whose last delivery's worker died
# was ended only when a worker had a free slot to pull its next delivery: while the pool was
# busy (its one slot generating a long answer), its readers heard nothing. Read from the stream,
# it is ended at ack_wait whatever the slots, as the advisory did.
async def test_a_request_given_up_on_is_ended_while_the_pools_slots_are_busy(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.stream.max_deliver = 1
    settings.stream.ack_wait = 1.0
    settings.worker.drain_grace = 0.5
    scope, rid = _scope(), "busy-1"
    async with _worker(settings, conn, "s20d-prov", _backend()):
        pass
    await _queue(conn, settings, scope, {"id": rid, "prompt": "[tag:q] x"}, f"{scope}.{rid}")
    await _dies_with_it(conn, settings)  # its last delivery's worker dies with it
    # The pool's one slot is busy with a long answer meanwhile (an engine slow on it).
    other, long = _scope(), "long-1"
    body = {"id": long, "prompt": "[tag:z] y", "max_tokens": 200}
    await _queue(conn, settings, other, body, f"{other}.{long}")
    async with _worker(settings, conn, "s20d-busy", _backend(slots=1, token_delay_ms=50)) as w:
        told: list[str] = []
        with contextlib.suppress(AssertionError):
            await eventually(lambda: _has_error(w, scope, rid, told), 4, "max_deliveries told")
        busy = not await _answered(w, other, long)
    assert told == ["max_deliveries"], (
        f"the reader of a request given up on hears nothing while the slot is busy ({busy})"
    )


async def _has_error(worker: Worker, scope: str, rid: str, told: list[str]) -> bool:
    told[:] = await _told(worker, scope, rid)
    return bool(told)


# A guard: a request that can wait refused as the worker decodes it (over this worker's
# max_tokens) keeps its typed error under the fingerprint its site compares, the site's own
# msgpack copy's (edge_node.site: request_fingerprint of the copy it holds and forwards).
async def test_a_refusal_at_decode_is_kept_under_the_fingerprint_the_site_looks_for(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.limits.max_tokens = 10
    scope, rid = _scope(), "fp-1"
    asked = InferRequest.model_validate(
        {"id": rid, "prompt": "[tag:q] go", "max_tokens": 30, "deferrable": True}
    )
    queued = asked.model_copy(
        update={"model": MODEL, "origin": "site-1", "stream": True, "reply": None}
    )
    async with _worker(settings, conn, "s20d-fp", _backend()):
        await conn.js.publish(
            infer_subject(MODEL, scope),
            dump(queued, WireFormat.MSGPACK),
            stream=settings.stream.name,
            headers={
                "Nats-Msg-Id": f"{scope}.{rid}.0123456789abcdef",
                CONTENT_TYPE: WireFormat.MSGPACK.content_type,
            },
        )
        await eventually(lambda: queue_drained(conn, settings, MODEL), 10, "the request let go")
    assert await _kept_soon(conn, scope, rid) is not None
    msg = await conn.jsm().get_msg(ANSWERS_STREAM, subject=answer_subject(scope, rid), direct=True)
    assert (msg.headers or {}).get("Mesh-Req") == request_fingerprint(queued)
