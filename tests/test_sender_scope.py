"""Request ids are unique within a sender's scope, read from its reply inbox. An inbox made for
one request (``_INBOX.<nuid>``: nats-py's ``request(..., old_style=True)``, nats.js ``noMux``)
names no connection: cut to ``_INBOX``, it made every such client one sender, so that two
unrelated clients using the same id had one refused as a duplicate (or, with the same prompt,
handed the other's answer)."""

from __future__ import annotations

import asyncio
import json

import nats

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import expected_text
from protocol.subjects import sender_scope


def test_a_scope_is_the_connections_part_of_an_inbox() -> None:
    assert sender_scope("_INBOX.abc.7") == "_INBOX.abc"  # one connection, many requests
    assert sender_scope("site1_inbox.abc.7") == "site1_inbox.abc"
    assert sender_scope("_INBOX.abc") == "_INBOX.abc"  # made for one request: its own
    assert sender_scope("reply") == "reply"


async def test_two_clients_of_one_request_inboxes_do_not_share_ids(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection
) -> None:
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=20, faults=False)
    )
    subject = f"mesh.v1.edge.{settings.edge.edge_id}.infer"
    alice = await nats.connect(nats_server.url)
    bob = await nats.connect(nats_server.url)
    try:
        async with EdgeNode(settings, conn, backend, HeuristicRouter()):

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
