"""A link that dies under a sender: what it wrote just before may never reach the server.

- An edge's: when that is an answer's tail, nothing after it shows the client the gap. Once the
  edge's link is back it sends each such client the answer's last event again, so the client
  asks for what it lacks at once instead of after its quiet spell. A ``nats req`` client (one
  reply) gets its answer again: it takes the first reply, and would otherwise time out.
- A client's: when that is the request itself, the edge never got it. Once the client's link is
  back its reader asks the edge for what it lacks; the edge does not know the request, and
  nothing of the answer came, so the client sends the request again instead of failing.
- A client's, straight to the cloud queue: the request's publish has no ack yet when the link is
  back, and it carries a message id, so it is published again at once (stored once), instead of
  the client waiting out the ack's timeout and failing.

Real nats-server; the edge and the client in this process, one of their links through a proxy
that first swallows what its side writes (the writes vanish, as in a link that is dying), then
drops.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import ask, expected_text, prompt
from mesh.testing.proxy import TcpProxy
from protocol.subjects import edge_infer_subject
from tests.conftest import linked_settings, make_settings
from tests.helpers import eventually
from tests.nats_wire import RawNatsClient, WireMsg


def _edge(settings: MeshSettings, conn: Connection, token_ms: float = 20) -> EdgeNode:
    """An edge answering locally with the deterministic backend, ``token_ms`` a token."""
    model = ModelSettings(backend="deterministic", name="smollm2", slots=2, token_delay_ms=token_ms)
    return EdgeNode(settings, conn, DeterministicBackend(model), HeuristicRouter())


async def _asked(
    cli: RawNatsClient, edge: EdgeNode, body: dict[str, object]
) -> asyncio.Task[WireMsg]:
    """``nats req`` to ``edge`` (JSON in, one reply), once the edge has taken it."""
    reply = asyncio.create_task(
        cli.request(edge_infer_subject(edge.edge_id), json.dumps(body).encode(), timeout=10)
    )

    async def taken() -> bool:
        return bool(edge.records.since(0.0))

    await eventually(taken, 10, "the edge to take the request")
    return reply


async def _answered_here(edge: EdgeNode) -> bool:
    return all(r.done for r in edge.records.since(0.0))


async def test_a_tail_lost_in_the_edges_dying_link_reaches_its_client_once_the_link_is_back(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mesh.reader._QUIET_FIRST_S", 30.0)  # only the edge's resync can heal
    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = linked_settings(proxy.url)
    client_settings = make_settings(nats_server.url)
    client_settings.edge.edge_id = edge_settings.edge.edge_id
    try:
        async with (
            Connection(edge_settings.nats, "resync-edge") as edge_conn,
            _edge(edge_settings, edge_conn) as edge,
            MeshClient(settings=client_settings, first_event_timeout=30, idle_timeout=30) as client,
        ):
            started = asyncio.Event()
            answer = asyncio.create_task(
                ask(client, "tail", 20, via="edge", route="local", first_token=started)
            )
            await asyncio.wait_for(started.wait(), 10)
            proxy.swallow()  # the rest of the answer, its end too, goes nowhere

            async def answered_here() -> bool:
                records = edge.records.since(0.0)
                return bool(records) and all(r.done for r in records)

            await eventually(answered_here, 10, "the edge to send the whole answer")
            assert not answer.done(), "the client got an answer the edge's link swallowed"
            back: list[float] = []

            async def stamp() -> None:
                back.append(time.monotonic())

            edge_conn.on_reconnect("stamp", stamp)
            proxy.cut(0.2)
            outcome = await asyncio.wait_for(answer, 10)
            assert outcome.kind == "correct", outcome
            assert back, "the edge did not reconnect"
            healed = outcome.token_times[-1] - back[0]
            print(f"\nthe edge back -> the client's last token: {healed:.3f} s")
            assert healed < 1.0, f"the tail came {healed:.2f} s after the edge was back"
    finally:
        await proxy.stop()


@pytest.mark.parametrize("outcome", ["answer", "err"])
async def test_a_nats_req_answer_lost_in_the_edges_dying_link_is_sent_again_once_it_is_back(
    nats_server: NatsServer, outcome: str
) -> None:
    """What the `nats` CLI does: JSON in, one JSON reply, no msgpack, no resend of its own. The
    reply is sent again whether it was the answer or a typed error (the engine failing after 15
    tokens; before, an error was not sent again, and the requester waited out its timeout)."""
    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = linked_settings(proxy.url)
    cli: RawNatsClient | None = None
    try:
        async with (
            Connection(edge_settings.nats, "req-edge") as edge_conn,
            _edge(edge_settings, edge_conn) as edge,
        ):
            # The CLI connects once the edge's subscriptions are in, or its request can miss
            # them (see docs/performance.md, the subscription window).
            cli = await RawNatsClient().connect(nats_server.url)
            fails = ("[fail-after:15]",) if outcome == "err" else ()
            body = {"prompt": prompt("req", *fails), "max_tokens": 20, "route": "local"}
            reply = await _asked(cli, edge, body)
            proxy.swallow()  # the one reply, when it is sent, goes nowhere

            await eventually(lambda: _answered_here(edge), 10, "the edge to send its answer")
            assert not reply.done(), (
                f"the reply came through a link that swallowed it: {reply.result().json()}"
            )
            proxy.cut(0.2)
            answer = (await asyncio.wait_for(reply, 10)).json()
            assert answer["t"] == outcome, answer
            if outcome == "answer":
                assert answer["text"] == expected_text("req", 20), answer
    finally:
        if cli is not None:
            await cli.close()
        await proxy.stop()


async def test_a_nats_req_answer_dropped_while_the_edge_reconnects_is_sent_once_it_is_back(
    nats_server: NatsServer,
) -> None:
    """The edge's link is down when the answer ends, and its reconnect buffer is full: the
    reply is dropped (the write batch marks the inbox, and its next put raises). The resync's
    put was that next one: it raised, and the requester waited out its timeout."""
    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = linked_settings(proxy.url)
    cli: RawNatsClient | None = None
    try:
        async with (
            Connection(edge_settings.nats, "full-edge") as edge_conn,
            _edge(edge_settings, edge_conn) as edge,
        ):
            cli = await RawNatsClient().connect(nats_server.url)
            body = {"prompt": prompt("full"), "max_tokens": 20, "route": "local"}
            reply = await _asked(cli, edge, body)
            edge_conn.nc._max_pending_size = 1  # a reconnect buffer that is full
            proxy.cut(2.0)  # down until after the answer ends (20 tokens, 20 ms each)

            await eventually(lambda: _answered_here(edge), 10, "the edge to end its answer")
            batch = edge_conn.write_batch
            assert batch._dropped, "nothing was dropped: the test proves nothing"
            answer = (await asyncio.wait_for(reply, 10)).json()
            assert answer["t"] == "answer" and answer["text"] == expected_text("full", 20)
    finally:
        if cli is not None:
            await cli.close()
        await proxy.stop()


async def test_a_request_lost_in_the_clients_dying_link_is_sent_again_once_the_link_is_back(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mesh.reader._QUIET_FIRST_S", 30.0)
    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = make_settings(nats_server.url)
    client_settings = linked_settings(proxy.url)
    client_settings.edge.edge_id = edge_settings.edge.edge_id
    try:
        async with (
            Connection(edge_settings.nats, "resend-edge") as edge_conn,
            _edge(edge_settings, edge_conn, token_ms=5),
            MeshClient(settings=client_settings, first_event_timeout=30, idle_timeout=30) as client,
        ):
            proxy.swallow()
            answer = asyncio.create_task(ask(client, "again", 12, via="edge", route="local"))
            subject = f"{edge_settings.edge.edge_id}.infer".encode()

            async def request_swallowed() -> bool:
                return subject in proxy.swallowed

            await eventually(request_swallowed, 10, "the request to go into the dying link")
            proxy.cut(0.2)
            outcome = await asyncio.wait_for(answer, 10)
            assert outcome.kind == "correct", outcome
            assert outcome.restarts == 0, outcome
    finally:
        await proxy.stop()


async def test_a_request_to_the_queue_lost_in_the_clients_dying_link_is_queued_once_it_is_back(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection
) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    client_settings = linked_settings(proxy.url)
    model = ModelSettings(backend="deterministic", name="smollm2", slots=2, token_delay_ms=5)
    try:
        async with (
            Worker(settings, conn, DeterministicBackend(model)),
            MeshClient(settings=client_settings, first_event_timeout=30, idle_timeout=30) as client,
        ):
            await ask(client, "warm", 2, via="cloud")  # the acks' subscription is in place
            proxy.swallow()
            answer = asyncio.create_task(ask(client, "queued", 12, via="cloud"))

            async def request_swallowed() -> bool:
                return b"mesh.v1.infer." in proxy.swallowed

            await eventually(request_swallowed, 10, "the request to go into the dying link")
            proxy.cut(0.2)
            outcome = await asyncio.wait_for(answer, 10)
            assert outcome.kind == "correct", outcome
            assert outcome.elapsed < client_settings.nats.request_timeout, outcome.elapsed
    finally:
        await proxy.stop()
