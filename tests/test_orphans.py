"""Handing back a dead worker's delivery (:mod:`cloud_node.orphans`) trusts only what the server
and the answer store say, never the reader: a forged ``start`` naming a dead worker and another
sender's delivery hands nothing back."""

from __future__ import annotations

import msgpack

from cloud_node.orphans import delivery_of
from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.queue import publish_request
from protocol.messages import InferRequest, StartEvent
from protocol.subjects import token_subject


def test_ack_subjects_in_both_forms() -> None:
    assert delivery_of("$JS.ACK.MESH_INFER.workers_m.2.41.7.1700000000000000000.0") == (
        "MESH_INFER",
        2,
        41,
    )
    v2 = "$JS.ACK.hub.ACCHASH.MESH_INFER.workers_m.1.9.3.1700000000000000000.0.rnd"
    assert delivery_of(v2) == ("MESH_INFER", 1, 9)
    assert delivery_of("mesh.v1.tok.a.b") is None
    assert delivery_of("$JS.ACK.MESH_INFER.workers_m.x.41.7.1.0") is None


async def _forge_start(conn: Connection, scope: str, request_id: str, **fields: object) -> None:
    start = StartEvent(id=request_id, node="cloud:ghost", **fields)  # type: ignore[arg-type]
    payload = msgpack.packb(start.model_dump(exclude_none=True))
    # Through JetStream: the answer store has it once this returns, and the worker reads it
    # there (a core publish and a flush left a race with the store under load).
    await conn.js.publish(token_subject(scope, request_id), payload)


async def test_a_forged_start_cannot_hand_back_another_senders_request(
    settings: MeshSettings, conn: Connection
) -> None:
    async with Worker(
        settings,
        conn,
        DeterministicBackend(ModelSettings(backend="deterministic", name="other-model")),
    ) as worker:
        victim = InferRequest(id="victim1", model="smollm2", prompt="hi", max_tokens=4)
        ack = await publish_request(conn, settings.stream, victim, "scope-a")
        forged = (
            f"$JS.ACK.{settings.stream.name}.workers_smollm2.1.{ack.seq}.1.1700000000000000000.0"
        )
        # Scope B claims a dead worker held ITS request under scope A's queue message.
        await _forge_start(conn, "scope-b", "mine1", delivery=forged)
        assert await worker.orphans.hand_back("scope-b", "mine1") == "not this request's delivery"
        # A delivery that is not this queue's, and a last delivery, are left alone too.
        await _forge_start(conn, "scope-b", "mine2", delivery="$JS.ACK.OTHER.c.1.5.1.1.0")
        assert await worker.orphans.hand_back("scope-b", "mine2") == "not this queue's delivery"
        last = forged.replace(
            ".workers_smollm2.1.", f".workers_smollm2.{settings.stream.max_deliver}."
        )
        await _forge_start(conn, "scope-a", "victim1", delivery=last)
        assert await worker.orphans.hand_back("scope-a", "victim1") == (
            "last delivery: left to JetStream"
        )
        # Nothing started, and a worker that answers, keep their deliveries.
        assert await worker.orphans.hand_back("scope-a", "never") == "not started"
        await _forge_start(conn, "scope-a", "victim2", delivery=forged)
        start = StartEvent(id="victim2", node=f"cloud:{worker.node_id}", attempt=2, delivery=forged)
        await conn.js.publish(
            token_subject("scope-a", "victim2"), msgpack.packb(start.model_dump(exclude_none=True))
        )
        assert await worker.orphans.hand_back("scope-a", "victim2") == "alive"
        assert worker.orphans.handed_back == 0
        # The sender's own request, its worker gone: handed back, once.
        await _forge_start(conn, "scope-a", "victim1", attempt=2, delivery=forged)
        assert await worker.orphans.hand_back("scope-a", "victim1") == "handed back"
        assert await worker.orphans.hand_back("scope-a", "victim1") == "handed back already"
        assert worker.orphans.handed_back == 1
