"""Identity and authority under hostile traffic: ids scoped to their sender, re-sent ids answered
again, cancels only from the sender, replies only where the mesh allows, and no message that
makes a node publish into the work queue, JetStream's API or another request."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest

from mesh.queue import cancel_payload
from mesh.testing.chaos import Tally, ask, prompt
from protocol.codec import decode_event
from protocol.messages import ErrorEvent
from protocol.subjects import edge_cancel_subject, edge_infer_subject, token_subject
from tests.chaos.conftest import Cluster
from tests.helpers import eventually

pytestmark = pytest.mark.chaos


async def queued_total(cluster: Cluster) -> int:
    """Messages ever stored in the work queue (its last sequence number)."""
    assert cluster.conn is not None
    info = await cluster.conn.jsm().stream_info("MESH_INFER")
    return int(info.state.last_seq)


async def test_ids_are_scoped_to_their_sender_and_answered_again(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=8)
    await cluster.edge()
    alice, bob = await cluster.client(), await cluster.client()
    tally = Tally()

    # Two clients, one id, different content: each gets its own answer.
    mine, theirs = await asyncio.gather(
        ask(alice, "alice", 40, via="edge", route="cloud", request_id="same-id"),
        ask(bob, "bob", 40, via="edge", route="cloud", request_id="same-id"),
    )
    assert mine.kind == theirs.kind == "correct", (mine, theirs)

    # One client sends one request twice at once: one generation, the answer twice.
    before = await queued_total(cluster)
    first, second = await asyncio.gather(
        ask(alice, "twice", 40, via="edge", route="cloud", request_id="again"),
        ask(alice, "twice", 40, via="edge", route="cloud", request_id="again"),
    )
    assert first.kind == second.kind == "correct", (first, second)
    assert await queued_total(cluster) == before + 1

    # Asked again after it finished: the same answer at once, no new generation.
    again = await ask(alice, "twice", 40, via="edge", route="cloud", request_id="again")
    assert again.kind == "correct" and again.elapsed < 1.0, again
    assert await queued_total(cluster) == before + 1

    # The same id with other content from the same sender: a typed duplicate error.
    other = await ask(alice, "other", 40, via="edge", route="cloud", request_id="again")
    assert (other.kind, other.detail) == ("typed", "duplicate"), other

    # Straight to the queue: sent again after it finished, the stored answer comes back.
    done = await ask(alice, "q1", 30, via="cloud", request_id="cloud-id")
    before = await queued_total(cluster)
    resent = await ask(alice, "q1", 30, via="cloud", request_id="cloud-id")
    assert done.kind == resent.kind == "correct" and resent.elapsed < 1.0, (done, resent)
    assert await queued_total(cluster) == before  # a duplicate publish is not queued
    # Another sender reusing that id for other content within the window: typed, not foreign.
    foreign = await ask(bob, "q2", 30, via="cloud", request_id="cloud-id")
    assert (foreign.kind, foreign.detail) == ("typed", "duplicate"), foreign

    for outcome in (mine, theirs, first, second, again, other, done, resent, foreign):
        tally.add(outcome)
    print("\n" + tally.row("duplicate and reused ids"))
    tally.assert_sound()


async def test_hostile_reply_id_and_cancel_traffic(cluster: Cluster) -> None:
    await cluster.worker("w1", slots=8)
    await cluster.edge()
    client = await cluster.client()
    assert cluster.conn is not None
    nc = cluster.conn.nc
    victims = [
        asyncio.ensure_future(ask(client, "v1", 100, via="cloud", request_id="victim-1")),
        asyncio.ensure_future(
            ask(client, "v2", 100, via="edge", route="cloud", request_id="victim-2")
        ),
    ]
    await asyncio.sleep(0.3)  # the victims are mid-answer
    watch = {rid: await nc.subscribe(token_subject("attacker", rid)) for rid in ("h1", "h2", "h3")}

    def queued(body: dict[str, object]) -> bytes:
        return json.dumps({"prompt": prompt("h"), "max_tokens": 8, **body}).encode()

    # Straight into the queue, as `nats pub mesh.v1.infer.smollm2.attacker '...'` would (on an
    # open server; `mesh creds` permissions would stop the attacker from naming another scope).
    hostile = [
        queued({"id": "h1", "reply": token_subject("anon", "victim-1")}),  # a victim's events
        queued({"id": "h2", "reply": "$JS.API.STREAM.PURGE.MESH_INFER"}),  # JetStream's API
        queued({"id": "h3", "reply": "mesh.v1.infer.smollm2.anon"}),  # the work queue itself
        queued({"id": "not.a.token"}),  # an id that is no subject token
        b"\x85\xa2garbage",  # not msgpack at all
    ]
    for payload in hostile:
        await nc.publish("mesh.v1.infer.smollm2.attacker", payload)
    # Cancels by someone who knows the victims' ids and scope but not their keys or inboxes.
    await nc.publish("mesh.v1.cancel.anon.victim-1", b"")
    await nc.publish("mesh.v1.cancel.anon.victim-1", cancel_payload("guessed-wrong-key"))
    await nc.publish(
        edge_cancel_subject(cluster.edge_id),
        json.dumps({"id": "victim-2", "inbox": "_INBOX.attacker.1"}).encode(),
    )
    # Edge requests whose reply subject points into the queue or JetStream's API.
    for reply in ("mesh.v1.infer.smollm2", "$JS.API.STREAM.DELETE.MESH_INFER"):
        await nc.publish(
            edge_infer_subject(cluster.edge_id),
            msgpack.packb({"prompt": prompt("h4"), "stream": True}),
            reply=reply,
        )
    await nc.flush()

    tally = Tally()
    for outcome in await asyncio.gather(*victims):
        tally.add(outcome)
    print("\n" + tally.row("hostile reply/id/cancel traffic (victims)"))
    tally.assert_sound()
    assert tally.counts()["correct"] == 2, cluster.logs()

    # Each hostile request with a readable id got a typed error on its own subject only.
    for rid, sub in watch.items():
        event = decode_event((await sub.next_msg(timeout=10)).data)
        assert isinstance(event, ErrorEvent) and event.code == "invalid_request", (rid, event)
    # Nothing was purged or deleted, every message was answered or terminated, and no message
    # made a node queue anything: 2 victims + 5 hostile messages were ever stored.
    jsm = cluster.conn.jsm()

    async def drained() -> bool:
        info = await jsm.stream_info("MESH_INFER")
        return info.state.messages == 0

    await eventually(drained, timeout=10, what="every queued message acked or terminated")
    assert await queued_total(cluster) == 7
    began = time.monotonic()
    after = await ask(client, "after", 10, via="edge", route="cloud")
    assert after.kind == "correct" and after.path == "cloud" and time.monotonic() - began < 5
