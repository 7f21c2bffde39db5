"""Hostile senders against real cloud workers: what anyone with a plain NATS connection (no SDK)
can do to a worker, and through it to other scopes' requests. Each test checks what the honest
sender got (its own answer, or its one typed error) and that the worker still serves.

Workers run in process on the deterministic backend (every answer checkable); NATS is a real
nats-server: an open one, or (where the point is what ``mesh creds`` permissions close) the
operator-mode hub of ``tests/test_security.py``, each process under its minted identity.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import msgpack
import nats.errors
import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.queue import MSG_ID_HEADER, publish_request
from mesh.testing.chaos import expected_text
from protocol.codec import decode_event
from protocol.errors import MeshError
from protocol.messages import Answer, EndEvent, ErrorEvent, InferRequest
from protocol.subjects import (
    ANSWERS_STREAM,
    answer_subject,
    cancel_subject,
    infer_subject,
    token_subject,
)
from tests.helpers import eventually
from tests.test_security import Denials, Hub, hub, mesh  # noqa: F401 - the secured hub's fixtures

MODEL = "smollm2"


@pytest.fixture
async def one_slot_worker(settings: MeshSettings, conn: Connection) -> AsyncIterator[Worker]:
    """A worker with one slot on the deterministic backend, 10 ms a token."""
    settings.worker.model.backend = "deterministic"
    settings.worker.model.slots = 1
    settings.worker.model.token_delay_ms = 10.0
    async with Worker(settings, conn, DeterministicBackend(settings.worker.model)) as running:
        yield running


async def _outcome(sub: object, timeout: float = 5.0) -> EndEvent | ErrorEvent:
    """Read a token subject's events until its end or error (JSON or msgpack)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        left = deadline - asyncio.get_running_loop().time()
        msg = await sub.next_msg(timeout=max(0.01, left))  # type: ignore[attr-defined]
        event = decode_event(msg.data)
        if isinstance(event, EndEvent | ErrorEvent):
            return event


# -- cancels ---------------------------------------------------------------------------------


async def test_a_flood_of_cancels_in_one_scope_does_not_forget_another_scopes_cancel(
    one_slot_worker: Worker, conn: Connection, settings: MeshSettings
) -> None:
    # A queued request's cancel is remembered until a worker fetches it. Anyone may publish
    # cancels in their own scope (under `mesh creds` too), for ids of their choosing: 12,000 of
    # them used to push the other scope's remembered cancel out (the book held 10,000 in all),
    # and the cancelled request was then generated in full.
    queue = infer_subject(MODEL, "victim")
    blocker = {"id": "blk-1", "prompt": "[hang] x", "max_tokens": 5, "cancel_key": "blocker-key"}
    await conn.js.publish(
        infer_subject(MODEL, "busy"), json.dumps(blocker).encode(), stream=settings.stream.name
    )
    await eventually(
        lambda: _holds(one_slot_worker, "busy", "blk-1"), timeout=5, what="the slot taken"
    )
    victim_sub = await conn.nc.subscribe(token_subject("victim", "v-1"))
    victim = {"id": "v-1", "prompt": "[tag:v] x", "max_tokens": 5, "cancel_key": "victim-key-1"}
    await conn.js.publish(queue, json.dumps(victim).encode(), stream=settings.stream.name)
    await conn.nc.publish(cancel_subject("victim", "v-1"), msgpack.packb({"key": "victim-key-1"}))
    for n in range(12_000):
        await conn.nc.publish(cancel_subject("flood", f"f{n}"), b"")
    # The worker handles the cancels in order: its reply to this one means it heard them all.
    reply = await conn.nc.request(cancel_subject("flood", "last"), b"", timeout=10)
    assert json.loads(reply.data) == {"held": False}
    await conn.nc.publish(
        cancel_subject("busy", "blk-1"), msgpack.packb({"key": "blocker-key"})
    )  # the slot frees; the victim's request is fetched next
    outcome = await _outcome(victim_sub)
    assert isinstance(outcome, ErrorEvent) and outcome.code == "cancelled", outcome
    # ... and the worker still serves.
    good = await conn.nc.subscribe(token_subject("victim", "v-2"))
    await conn.js.publish(
        queue,
        b'{"id": "v-2", "prompt": "[tag:g] x", "max_tokens": 4}',
        stream=settings.stream.name,
    )
    assert isinstance(await _outcome(good), EndEvent)


async def _holds(worker: Worker, scope: str, request_id: str) -> bool:
    return token_subject(scope, request_id) in worker.handler.inflight


async def test_a_cancel_cannot_make_a_worker_write_its_reply_into_another_scope(
    mesh: Hub,  # noqa: F811
) -> None:
    # A worker answers an addressed cancel ({"held": ...}) on the cancel's reply subject, which
    # the sender names. Under `mesh creds` an edge may only cancel in its own lane, but it may
    # name any reply subject, and the worker's own rights (every scope's kept answers, token
    # subjects, its registry key) plus its response permission carried the write: edge A
    # overwrote edge B's kept answer with '{"held": false}'.
    edge_b = await Denials().connect(mesh, "edge-site-b")
    edge_a = await Denials().connect(mesh, "edge-site-a")
    operator = mesh.settings("operator")
    try:
        assert edge_a.nc is not None and edge_b.nc is not None
        body = {"id": "kept-1", "prompt": "[tag:k] x", "max_tokens": 5, "deferrable": True}
        await edge_b.nc.publish(infer_subject(MODEL, "site-b"), json.dumps(body).encode())
        async with Connection(operator.nats, "op") as op:

            async def kept() -> Answer | None:
                try:
                    msg = await op.jsm().get_msg(
                        ANSWERS_STREAM, subject=answer_subject("site-b", "kept-1"), direct=True
                    )
                except Exception:  # not kept yet
                    return None
                try:
                    event = decode_event(msg.data or b"")
                except MeshError:  # something that is no answer at all
                    return None
                return event if isinstance(event, Answer) else None

            async def is_kept() -> bool:
                return await kept() is not None

            await eventually(is_kept, timeout=5, what="B's answer kept")
            targets = (
                answer_subject("site-b", "kept-1"),
                token_subject("site-b", "kept-1"),
                "$KV.mesh_nodes.worker.smollm2.w1",
            )
            for target in targets:
                for subject in ("mesh.v1.cancel.site-a.x", "mesh.v1.worker.w1.cancel.site-a.x"):
                    await edge_a.nc.publish(subject, b"", reply=target)
            # Each subscription handles its cancels in order: these replies come after.
            for subject in ("mesh.v1.cancel.site-a.y", "mesh.v1.worker.w1.cancel.site-a.y"):
                reply = await edge_a.nc.request(subject, b"", timeout=5)
                assert json.loads(reply.data) == {"held": False}  # its own inbox still hears
            await op.nc.flush()
            answer = await kept()
            assert answer is not None and answer.text == expected_text("k", 5), answer
            events = await _raw_events(op, token_subject("site-b", "kept-1"))
            assert events and all(b"held" not in e for e in events), events
    finally:
        await edge_a.close()
        await edge_b.close()


async def _raw_events(op: Connection, subject: str) -> list[bytes]:
    found: list[bytes] = []
    sub = await op.js.subscribe(subject, ordered_consumer=True)
    try:
        while True:
            try:
                msg: Msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:  # no more
                return found
            found.append(msg.data)
    finally:
        await sub.unsubscribe()


# -- what `mesh creds` closes ------------------------------------------------------------------


async def test_an_edge_cannot_forge_answers_leases_or_advisories_under_creds(
    mesh: Hub,  # noqa: F811
) -> None:
    # On an open server anyone may publish into any scope's token subject, kept answer or lease,
    # or forge JetStream's max-deliveries advisory (the worker then deletes the queued message
    # it names and answers it max_deliveries). Under `mesh creds` an edge can do none of it,
    # not even in its own scope: only workers (and the server) write there.
    spy = await Denials().connect(mesh, "edge-site-a")
    try:
        assert spy.nc is not None
        for subject in (
            token_subject("site-b", "x"),
            token_subject("site-a", "x"),
            answer_subject("site-b", "x"),
            "mesh.v1.lease.site-b.x",
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.MESH_INFER.workers_smollm2",
        ):
            await spy.nc.publish(subject, b'{"stream_seq": 1, "deliveries": 3}')
            await spy.refused("Publish", subject)
    finally:
        await spy.close()


# -- ids: the queue's dedupe window --------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="JetStream dedupes by Nats-Msg-Id across the whole stream, and a direct publisher's "
    "id is '<scope>.<request id>' on purpose (one id, one request, across a scope's senders), "
    "which any sender may set on its own lane. Under mesh creds only edges publish to the "
    "queue: their relays draw random ids, and a site's forward of a held request carries a tag "
    "only that site can make (tests/test_edge_site.py). Left open for direct publishers (the "
    "SDK via the cloud with an id of its own), on servers where senders share more anyway.",
)
async def test_a_sender_cannot_keep_another_scopes_request_out_of_the_queue(
    mesh: Hub,  # noqa: F811
) -> None:
    squatter = await Denials().connect(mesh, "edge-site-a")
    settings = mesh.settings("edge-site-b")
    try:
        assert squatter.nc is not None
        # Edge A queues in its own lane, under the message id B's request will carry.
        await squatter.nc.publish(
            infer_subject(MODEL, "site-a"),
            b'{"id": "sq-1", "prompt": "[tag:a] x", "max_tokens": 3}',
            headers={MSG_ID_HEADER: "site-b.report-1"},
        )
        await squatter.nc.flush()
        await asyncio.sleep(0.2)
        async with Connection(settings.nats, "edge-b") as conn:
            sub = await conn.nc.subscribe(token_subject("site-b", "report-1"))
            request = InferRequest(id="report-1", model=MODEL, prompt="[tag:b] x", max_tokens=4)
            await publish_request(conn, settings.stream, request, "site-b")
            outcome = await _outcome(sub, timeout=3)
        assert isinstance(outcome, EndEvent)
    finally:
        await squatter.close()
