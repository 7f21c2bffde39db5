"""What an edge can make the *server* publish into another edge's lane (issue 21's audit).

A real hub in operator mode with the credentials `mesh creds` mints, edges A and B and a
worker, as in ``tests/test_security.py``. Edge A's credentials try each way of having the
server (not A itself, whose publishes its permissions bound) publish on B's subjects, while an
operator listens on B's token and queue subjects.

Inside one account, nats-server checks neither a push consumer's deliver subject nor an API
request's reply subject. So each edge has an account of its own, importing only its slice of
the ``MESH`` account (``mesh_app/accounts.py``), and creates no consumer at all: a reply or a
delivery it names lands in its own account, where nobody else listens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from mesh.connection import Connection
from mesh.status import collect_status
from tests.test_security import (  # noqa: F401 - fixtures
    Denials,
    Hub,
    _ask,
    hub,
    mesh,
)

B_TOKENS = "mesh.v1.tok.site-b.probe"
B_QUEUE = "mesh.v1.infer.probe.site-b"
"""B's queue lane (a model nobody serves: B's own requests go to another)."""


class Listener:
    """An operator's subscriptions on B's lane: what the server put there. Literal subjects, as
    B's edge subscribes to each answer's (a push consumer delivers to interest on its deliver
    subject, under the message's own subject: counted here by subscription)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def on(self, subject: str) -> Callable[[Msg], Awaitable[None]]:
        async def count(_msg: Msg) -> None:
            self.seen[subject] = self.seen.get(subject, 0) + 1

        return count


@pytest.fixture
async def lane_b(mesh: Hub) -> AsyncIterator[Listener]:  # noqa: F811
    listener = Listener()
    async with Connection(mesh.settings("operator").nats, "op") as op:
        for subject in (B_TOKENS, B_QUEUE):
            await op.nc.subscribe(subject, cb=listener.on(subject))
        await op.nc.flush()
        yield listener


async def _attack(
    mesh: Hub,  # noqa: F811
    lane_b: Listener,
    subject: str,
    body: dict[str, Any],
    reply: str = "",
    *,
    refused: bool = True,
) -> None:
    """Edge A's call, while B's answer streams; ``refused``: the server must refuse the call
    itself (A may not make it at all), else it is one A may make, answered in A's account."""
    spy = await Denials().connect(mesh, "edge-site-a")
    try:
        assert spy.nc is not None
        victim = asyncio.ensure_future(_ask(mesh, "site-b", "[tag:v] x", 40))
        if not refused:  # the call works: answered on A's own inbox
            answer = await spy.nc.request(subject, json.dumps(body).encode(), timeout=5)
            assert answer.data, "the call itself got no answer: the test proves nothing"
        await spy.nc.publish(subject, json.dumps(body).encode(), reply=reply)
        await spy.nc.flush()
        if refused:
            await spy.refused("Publish", subject)
        # B's answer is exact either way; then nothing of A's may have reached B's lane.
        assert await victim == "".join(f" v{i}" for i in range(40))
        # What the server delivers comes a moment after the call; a bounded look for it.
        await asyncio.sleep(0.3)
        assert lane_b.seen == {}
    finally:
        await spy.close()


async def test_a_registry_consumer_cannot_deliver_into_another_lane(
    mesh: Hub,  # noqa: F811
    lane_b: Listener,
) -> None:
    config = {"stream_name": "KV_mesh_nodes", "config": {"deliver_subject": B_TOKENS}}
    await _attack(mesh, lane_b, "$JS.API.CONSUMER.CREATE.KV_mesh_nodes", config)


async def test_a_repair_consumer_cannot_deliver_into_another_queue(
    mesh: Hub,  # noqa: F811
    lane_b: Listener,
) -> None:
    await _ask(mesh, "site-a", "[tag:s] seed", 5)  # something of A's in the store to deliver
    config = {
        "stream_name": "MESH_TOK",
        "config": {
            "name": "spy",
            "deliver_subject": B_QUEUE,
            "filter_subject": "mesh.v1.tok.site-a.*",
        },
    }
    subject = "$JS.API.CONSUMER.CREATE.MESH_TOK.spy.mesh.v1.tok.site-a.*"
    await _attack(mesh, lane_b, subject, config)


async def test_an_api_reply_cannot_land_in_another_lane(
    mesh: Hub,  # noqa: F811
    lane_b: Listener,
) -> None:
    subject = "$JS.API.STREAM.INFO.KV_mesh_nodes"  # A may read the registry
    await _attack(mesh, lane_b, subject, {}, reply=B_TOKENS, refused=False)


async def test_a_client_cannot_have_its_edge_answer_into_another_lane(
    mesh: Hub,  # noqa: F811
    lane_b: Listener,
) -> None:
    """The edge answers a request's reply subject under its own response permission, which the
    server grants for any reply subject; the edge itself refuses mesh and server subjects."""
    client = await Denials().connect(mesh, "client-site-a")
    try:
        assert client.nc is not None
        request = {"id": "r1", "prompt": "[tag:c] x", "max_tokens": 5, "route": "cloud"}
        for reply in (B_QUEUE, B_TOKENS):
            await client.nc.publish(
                "mesh.v1.edge.site-a.infer", json.dumps(request).encode(), reply=reply
            )
        await client.nc.flush()
        assert await _ask(mesh, "site-b", "[tag:w] x", 10) == "".join(f" w{i}" for i in range(10))
        await asyncio.sleep(0.3)  # as in _attack: a bounded look
        assert lane_b.seen == {}
    finally:
        await client.close()


async def test_the_operators_mesh_status_lists_edges_in_their_own_accounts(
    mesh: Hub,  # noqa: F811
) -> None:
    """The operator (account MESH) does not see the edges' micro services; it asks every edge
    on the subject each edge's account imports, and each answers on its own exported subject."""
    operator = mesh.settings("operator")
    async with Connection(operator.nats, "op") as conn:
        status = await collect_status(conn, operator)
    assert sorted(e["edge_id"] for e in status["edges"]) == ["site-a", "site-b"]
    assert all(e["counters"].get("behind") is False for e in status["edges"])
    assert [w["node_id"] for w in status["workers"]] == ["w1"]
    # An edge hears the ask, but not another edge's answer: B's status is not in A's account.
    spy = await Denials().connect(mesh, "edge-site-a")
    try:
        await spy.cannot_subscribe("mesh.v1.status.edge.site-b")
    finally:
        await spy.close()
