"""Request ids are unique within a sender's scope, read from its reply inbox. An inbox made for
one request (``_INBOX.<nuid>``: nats-py's ``request(..., old_style=True)``, nats.js ``noMux``)
names no connection: cut to ``_INBOX``, it made every such client one sender, so that two
unrelated clients using the same id had one refused as a duplicate (or, with the same prompt,
handed the other's answer)."""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import expected_text
from protocol.subjects import sender_scope

NUID = "Abcdefghij0123456789XY"  # what a NATS client names its connection's inboxes by


def test_a_scope_is_the_connections_part_of_an_inbox() -> None:
    # One connection, many requests: nats-py, Go (the `nats` CLI), the SDK.
    assert sender_scope(f"_INBOX.{NUID}.7") == f"_INBOX.{NUID}"
    assert sender_scope(f"_INBOX.{NUID}.{NUID}") == f"_INBOX.{NUID}"
    assert sender_scope(f"_INBOX.client.app1.{NUID}.x8Yz") == f"_INBOX.client.app1.{NUID}"
    # An inbox made for one request, or a reply of the client's choosing: a scope of its own.
    assert sender_scope(f"_INBOX.{NUID}") == f"_INBOX.{NUID}"
    assert sender_scope(f"_INBOX.client.app1.{NUID}") == f"_INBOX.client.app1.{NUID}"
    assert sender_scope("replies.mine.7") == "replies.mine.7"
    assert sender_scope("reply") == "reply"


@pytest.mark.parametrize("prefix", [None, "_INBOX.client.app1"])
async def test_two_clients_of_one_request_inboxes_do_not_share_ids(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection, prefix: str | None
) -> None:
    """Each with nats-py's own prefix, or both as processes of one app under `mesh creds`."""
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=20, faults=False)
    )
    subject = f"mesh.v1.edge.{settings.edge.edge_id}.infer"
    inboxes = {"inbox_prefix": prefix} if prefix else {}
    alice = await nats.connect(nats_server.url, **inboxes)
    bob = await nats.connect(nats_server.url, **inboxes)
    try:
        async with EdgeNode(settings, conn, backend, HeuristicRouter()):
            # Both connected before the edge subscribed, and Alice asks at once: the edge's start
            # makes sure the server has its subscriptions (Connection.subscribed).
            def ask(tag: str) -> bytes:
                body = {"id": "job-1", "prompt": f"[tag:{tag}] count", "max_tokens": 10}
                return json.dumps({**body, "route": "local"}).encode()

            first = asyncio.ensure_future(alice.request(subject, ask("al"), 10, old_style=True))
            await asyncio.sleep(0.05)  # Alice's is under way when Bob's comes
            second = asyncio.ensure_future(bob.request(subject, ask("bo"), 10, old_style=True))
            for reply, tag in ((await first, "al"), (await second, "bo")):
                answer = json.loads(reply.data)
                assert answer.get("text") == expected_text(tag, 10), answer
    finally:
        await alice.close()
        await bob.close()
