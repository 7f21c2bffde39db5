"""An edge is sent only the answers it reads: guards kept from review S22 of 8e1a641 (an edge
alone in its scope reading its answers through one wildcard subscription to
``mesh.v1.tok.<edge>.*``), reverted in a39356e. Each test failed on 8e1a641.

The wildcard is interest in every answer under the edge's scope, not only the ones this edge
process escalated: another sender in the same scope (an SDK under the edge's credentials, which
must use the edge's scope; a replica of the edge, sharing its edge id) has each of its answers'
messages delivered to this edge as well, where they are dropped. docs/performance.md names this
as the reason the same change was tried before and not kept ("it also pulls in every token under
the edge's scope that nobody reads live: the answers of a site's deferrable requests, across
the leaf uplink, and the answers of replicas that share an edge id").

Real nats-server; the edge's reads are recorded at its transport (as tests/test_edge_writes.py
does) and the answer messages counted by their subject.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text
from tests.conftest import make_settings
from tests.test_edge_site import Topology, running_mesh, topology  # noqa: F401 - a fixture
from tests.test_edge_writes import _recorded
from tests.test_routing_edges import _det
from tests.test_security import certs  # noqa: F401 - a fixture

TOKENS = 40


def _answer_messages(reads: list[bytes], scope: str) -> int:
    """Messages on ``scope``'s token subjects among what a connection read."""
    return b"".join(reads).count(f" mesh.v1.tok.{scope}.".encode())


async def _ask_through_nats(nc: Any, subject: str, tag: str) -> list[dict[str, Any]]:
    """Ask an edge as the ``nats`` CLI would and read the whole stream."""
    inbox = nc.new_inbox()
    got: list[dict[str, Any]] = []
    ended = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        got.append(json.loads(msg.data))
        if got[-1]["t"] in ("end", "err"):
            ended.set()

    sub = await nc.subscribe(inbox, cb=on_msg)
    ask = {"prompt": f"[tag:{tag}] hi", "route": "cloud", "stream": True, "max_tokens": TOKENS}
    await nc.publish(subject, json.dumps(ask).encode(), inbox)
    await asyncio.wait_for(ended.wait(), 20)
    await sub.unsubscribe()
    return got


async def test_an_sdk_in_the_edges_scope_does_not_send_its_answers_through_the_edge(
    settings: MeshSettings,
) -> None:
    """An SDK that queues straight to the cloud in the edge's scope (as it must under the
    edge's credentials): its answer is whole, and the edge, which escalated nothing
    meanwhile, is sent none of its messages (8e1a641: every one)."""
    edge_id = settings.edge.edge_id
    settings.nats.scope = edge_id  # the SDK's scope: the edge's, as under its credentials
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "edge") as econn,
        Worker(settings, wconn, _det("smollm2", 4, token_ms=5)),
        EdgeNode(settings, econn, _det("smollm2", 4), HeuristicRouter()) as edge,
    ):
        assert edge.scope == edge_id
        async with MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as sdk:
            # The edge escalates once (its first escalation subscribes, as before per request).
            warm = await sdk.complete("[tag:w] hi", route="cloud", max_tokens=3)
            assert warm.text == " w0 w1 w2" and warm.end.path == "cloud"
            reads, _writes = _recorded(econn.nc._transport)
            direct = await sdk.complete("[tag:d] hi", via="cloud", max_tokens=TOKENS)
            assert direct.text == expected_text("d", TOKENS)
            # Anything still on its way to the edge arrives before the round trip ends.
            await econn.nc.flush()
        pulled = _answer_messages(reads, edge_id)
        assert pulled == 0, f"the edge was sent {pulled} messages of an answer it never asked for"


async def test_a_replica_of_an_edge_is_not_sent_the_answers_of_the_other(
    nats_server: Any,
) -> None:
    """Two replicas of one edge (one edge id, hence one scope), each on its own connection. A
    client's answer is relayed by one of them; the other, which escalated nothing meanwhile,
    is sent none of its messages (8e1a641: every one, to every replica)."""
    base = make_settings(nats_server.url)
    other = make_settings(nats_server.url)
    other.edge.edge_id = base.edge.edge_id
    edge_id = base.edge.edge_id
    async with (
        Connection(base.nats, "worker") as wconn,
        Connection(base.nats, "edge-1") as conn1,
        Connection(other.nats, "edge-2") as conn2,
        Worker(base, wconn, _det("smollm2", 4, token_ms=5)),
        EdgeNode(base, conn1, _det("smollm2", 4), HeuristicRouter()) as edge1,
        EdgeNode(other, conn2, _det("smollm2", 4), HeuristicRouter()),
    ):
        nc = await nats.connect(base.nats.url)
        try:
            # Each replica escalates (the queue group spreads the asks: 12 leave one of the two
            # without any once in 2,000 runs).
            for i in range(12):
                got = await _ask_through_nats(nc, edge1.subject, f"w{i}")
                assert got[-1]["t"] == "end", got[-1]
            reads1, _ = _recorded(conn1.nc._transport)
            reads2, _ = _recorded(conn2.nc._transport)
            got = await _ask_through_nats(nc, edge1.subject, "r")
            texts = "".join(e.get("text", "") for e in got if e["t"] == "tok")
            assert texts == expected_text("r", TOKENS) and got[-1]["t"] == "end"
            await conn1.nc.flush()
            await conn2.nc.flush()
        finally:
            await nc.close()
    pulled = sorted([_answer_messages(reads1, edge_id), _answer_messages(reads2, edge_id)])
    # The replica that relayed the answer read it (pulled[1]); the other should read nothing.
    assert pulled[1] > 0
    assert pulled[0] == 0, f"the idle replica was sent {pulled[0]} messages of the other's answer"


async def test_a_site_edge_is_not_sent_the_answers_its_site_keeps_for_later(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """An edge on its site's leaf node: a request that can wait is answered through the
    site's store (held, forwarded, its answer collected and kept), not read live. Its answer's
    messages have no reader at the site, so they do not cross the uplink to the edge (8e1a641:
    every one, through the leaf, to an edge that drops them)."""
    site = "site-a"
    async with running_mesh(topology):
        edge = topology.edges[site]
        assert edge.site is not None and edge.scope == site
        async with MeshClient(settings=topology.site_settings(site, "client")) as client:
            live = await client.complete("[tag:l] x", route="cloud", max_tokens=4)
            assert live.path == "cloud" and live.text == expected_text("l", 4)
            reads, _ = _recorded(edge.conn.nc._transport)
            kept = await client.complete(
                "[tag:k] x", route="cloud", max_tokens=TOKENS, deferrable=True, request_id="k-1"
            )
            assert kept.path == "cloud" and kept.text == expected_text("k", TOKENS)
            await edge.conn.nc.flush()
    pulled = _answer_messages(reads, site)
    assert pulled == 0, f"{pulled} messages of a kept answer crossed the uplink to the edge"
