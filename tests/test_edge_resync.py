"""An edge whose link dies under it: what it wrote to a client just before may never reach the
server, and when that is an answer's tail, nothing after it shows the client the gap. Once the
edge's link is back it sends each such client the answer's last event again, so the client asks
for what it lacks at once instead of after its quiet spell.

Real nats-server; the edge in this process, its link through a proxy that first swallows what
the edge writes (the writes vanish, as they do in a link that is dying), then drops.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import ask
from mesh.testing.proxy import TcpProxy
from tests.conftest import make_settings
from tests.helpers import eventually


async def test_a_tail_lost_in_the_edges_dying_link_reaches_its_client_once_the_link_is_back(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mesh.reader._QUIET_FIRST_S", 30.0)  # only the edge's resync can heal
    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = make_settings(proxy.url)
    edge_settings.nats.reconnect_wait = 0.1
    client_settings = make_settings(nats_server.url)
    client_settings.edge.edge_id = edge_settings.edge.edge_id
    model = ModelSettings(backend="deterministic", name="smollm2", slots=2, token_delay_ms=20)
    try:
        async with (
            Connection(edge_settings.nats, "resync-edge") as edge_conn,
            EdgeNode(
                edge_settings, edge_conn, DeterministicBackend(model), HeuristicRouter()
            ) as edge,
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
