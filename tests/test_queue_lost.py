"""The work queue lost under a request that waits in it, with every link up (``nats stream rm``
on the hub): a one-slot worker busy with one answer, a second request queued behind it, and the
queue deleted. The worker puts the queue back (``tests/test_lost_state.py``); the sender's
queue watch (:mod:`mesh.queue_watch`) hears JetStream say the pool's consumer was made again,
looks, and queues the waiting request again. Both are answered by the cloud, exactly. Before,
the queued request was gone: the SDK waited for its first event until its timeout, and an edge
answered locally after its ``cloud_start_timeout`` (10 s). Then the watch's next look found it
(1.1 s after the deletion). Here the looks are a minute apart: only the word brings it back in
time."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.errors import NotFoundError

import mesh.queue_watch
from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import expected_text
from tests.conftest import make_settings
from tests.helpers import eventually, holds
from tests.test_edge_site import (  # noqa: F401 - topology is a fixture
    Topology,
    site_edge_and_worker,
    topology,
)
from tests.test_security import certs  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def _looks_a_minute_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's own looks (once a second) would find the queue back too: not within this."""
    monkeypatch.setattr(mesh.queue_watch, "LOOK_S", 60.0)


async def _queued(conn: Connection, stream: str, n: int) -> bool:
    try:
        return (await conn.jsm().stream_info(stream)).state.messages >= n
    except NotFoundError:  # deleted, not put back yet
        return False


@pytest.mark.parametrize("via", ["cloud", "edge"])
async def test_a_request_waiting_when_its_queue_is_deleted_is_answered(
    own_server: NatsServer, via: str
) -> None:
    settings = make_settings(own_server.url)
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=1, token_delay_ms=50)
    )
    local = DeterministicBackend(ModelSettings(backend="deterministic", slots=1))
    how = {"via": "cloud"} if via == "cloud" else {"route": "cloud"}
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "edge") as econn,
        Connection(settings.nats, "operator") as op,
        Worker(settings, wconn, backend),
        EdgeNode(settings, econn, local, HeuristicRouter()) as edge,
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        model = settings.edge.cloud_model
        await eventually(lambda: holds(edge.nodes.serves(model) is True), what="the worker seen")
        busy = asyncio.ensure_future(client.complete("[tag:a] x", max_tokens=20, **how))  # type: ignore[arg-type]
        await eventually(lambda: holds(backend.started >= 1), what="the slot taken")
        waiting = asyncio.ensure_future(client.complete("[tag:b] x", max_tokens=4, **how))  # type: ignore[arg-type]
        again, took = await _deleted_under(op, settings.stream.name, 2, waiting)
        first = await asyncio.wait_for(busy, 30)
        assert first.path == "cloud" and first.text == expected_text("a", 20)
        print(f"\nqueue deleted via {via}: queued again in {again:.2f} s, answered in {took:.2f} s")
        assert took < 5.0, took


async def test_a_site_edge_gets_its_waiting_request_answered_after_the_queue_is_deleted(
    topology: Topology,  # noqa: F811 - the fixture
) -> None:
    """The same through an edge on its site's leaf node (TLS, accounts, the hub's JetStream
    domain): its own link, to the leaf, never drops, so only the watch's look at the hub's
    consumer tells it. A hub restarted on an empty store reads the same from there."""
    hub = topology.hub_settings("operator")
    async with (
        site_edge_and_worker(topology, "site-a", token_delay_ms=50) as (backend, _edge, client),
        Connection(hub.nats, "operator") as op,
    ):
        slots = backend.settings.slots
        busy = [
            asyncio.ensure_future(client.complete(f"[tag:a{i}] x", route="cloud", max_tokens=20))
            for i in range(slots)
        ]
        await eventually(lambda: holds(backend.started >= slots), what="the slots taken")
        waiting = asyncio.ensure_future(client.complete("[tag:b] x", route="cloud", max_tokens=4))
        again, took = await _deleted_under(op, hub.stream.name, slots + 1, waiting)
        for i, answer in enumerate(await asyncio.gather(*busy)):
            assert answer.path == "cloud" and answer.text == expected_text(f"a{i}", 20)
        print(
            f"\nqueue deleted under a site's edge: queued again in {again:.2f} s,"
            f" answered in {took:.2f} s"
        )
        assert took < 5.0, took


async def _deleted_under(
    op: Connection, stream: str, queued: int, waiting: asyncio.Future[Completion]
) -> tuple[float, float]:
    """Delete the queue once ``queued`` requests are in it; the seconds until ``waiting``, the
    last of them, was in the queue put back, and until it was answered by the cloud, exactly
    (its worker's slots are busy until then)."""
    await eventually(lambda: _queued(op, stream, queued), what="the request queued")
    await op.jsm().delete_stream(stream)
    deleted = time.monotonic()
    await eventually(lambda: _queued(op, stream, 1), timeout=20, what="the request queued again")
    again = time.monotonic() - deleted
    answer = await asyncio.wait_for(waiting, 30)
    took = time.monotonic() - deleted
    assert answer.path == "cloud", answer.end.fallback
    assert answer.text == expected_text("b", 4)
    return again, took
