"""The edge asks the workers its registry view shows whether they are there
(:meth:`edge_node.served.CloudModels.ask_workers`): one the server says nobody listens for is
forgotten at once; one that answers, one that is slow to answer, and one away for a moment (a
worker moving to another server) are kept. Real nats-server; the workers are plain
subscriptions on their ``alive`` subjects, as a worker's."""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.served import CloudModels
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import NOBODY_AGAIN_S, Connection
from mesh.nats_server import NatsServer
from mesh.node_view import NodeView
from mesh.registry import NodeInfo, node_key, open_bucket
from mesh.testing.chaos import expected_text
from protocol.subjects import worker_alives
from tests.helpers import eventually, holds


def _value(node: str) -> bytes:
    info = NodeInfo(node_id=node, role="worker", models=["smollm2"], slots=2, free=0)
    return info.model_dump_json().encode()


async def test_the_edge_forgets_only_the_workers_the_server_says_are_gone(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection
) -> None:
    kv = await open_bucket(conn, 30.0)
    for node in ("alive", "slow", "moving", "dead"):
        await kv.put(node_key("worker", node, "smollm2"), _value(node))
    workers = await nats.connect(nats_server.url)
    subs: list[Any] = []

    async def answer(msg: Msg) -> None:
        await msg.respond(b"{}")

    async def answer_late(msg: Msg) -> None:
        await asyncio.sleep(1.0)  # busy: later than the edge waits

    subs.append(await workers.subscribe(worker_alives("alive"), cb=answer))
    subs.append(await workers.subscribe(worker_alives("slow"), cb=answer_late))
    await workers.flush()
    view = NodeView(conn, 30.0, pool="smollm2")
    await view.start()
    models = CloudModels(conn, settings.stream, view, "scope-a")
    try:
        assert {i.node_id for i in view.live()} == {"alive", "slow", "moving", "dead"}

        async def back_soon() -> None:  # "moving" is away at the first question only
            await asyncio.sleep(NOBODY_AGAIN_S / 2)
            subs.append(await workers.subscribe(worker_alives("moving"), cb=answer))
            await workers.flush()

        moving = asyncio.create_task(back_soon())
        models.ask_workers("smollm2")

        async def dead_forgotten() -> bool:
            return "dead" not in {i.node_id for i in view.live()}

        await eventually(dead_forgotten, 5, "the dead worker forgotten")
        await moving
        await asyncio.gather(*models._asking)  # every question had its answer or its time
        assert {i.node_id for i in view.live()} == {"alive", "slow", "moving"}
        assert view.serves("smollm2") is True
        models.ask_workers("smollm2")  # within a second of the last round: not asked again
        assert not models._asking
    finally:
        await models.close()
        await view.stop()
        await workers.close()


async def test_a_registry_gone_silent_as_a_whole_says_nothing_of_its_workers(
    nats_server: NatsServer,
    settings: MeshSettings,
    conn: Connection,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No update from anyone for a ttl, and the registry's stream not seen working (electing a
    leader, its bucket refusing writes: here its look gets no answer) ages every entry at once:
    the view cannot tell then, rather than say the pool is gone while its workers serve. The
    workers are asked: one the server says nobody listens for is gone, one that answers is
    there (as if its heartbeat had come), and the view says no only once no worker of the pool
    is left to tell of. An update from anyone ends the silence. (A registry that works says
    the silence is the workers' own: ``tests/test_hung_worker.py``.)"""
    ttl = 1.0

    async def no_answer(_view: NodeView) -> None:
        _view._looking = None

    monkeypatch.setattr(NodeView, "_look", no_answer)
    kv = await open_bucket(conn, 30.0)
    for node in ("there", "dead"):
        await kv.put(node_key("worker", node, "smollm2"), _value(node))
    workers = await nats.connect(nats_server.url)

    async def answer(msg: Msg) -> None:
        await msg.respond(b"{}")

    there = await workers.subscribe(worker_alives("there"), cb=answer)
    await workers.flush()
    view = NodeView(conn, ttl, pool="smollm2")
    await view.start()
    view._reconnected_at = -ttl  # ready at once (no reconnect to wait out here)
    models = CloudModels(conn, settings.stream, view, "scope-a")
    try:
        assert view.serves("smollm2") is True
        await eventually(lambda: holds(view.silent), 5, "the registry silent for a ttl")
        assert view.live() == []  # every entry aged out
        assert view.serves("smollm2") is None  # False before: the pool taken for gone
        assert view.is_live("there", "smollm2") is None
        models.ask_workers("smollm2")
        await eventually(lambda: holds("dead" not in _ids(view)), 5, "the dead one forgotten")
        await asyncio.gather(*models._asking)
        assert _ids(view) == {"there"}
        assert view.serves("smollm2") is True and view.is_live("there", "smollm2") is True
        await there.unsubscribe()  # now the last one dies too
        await workers.flush()
        await eventually(lambda: holds(view.serves("smollm2") is None), 5, "its answer aged out")
        models._asked.clear()  # a new round at once
        models.ask_workers("smollm2")
        await eventually(lambda: holds(view.serves("smollm2") is False), 5, "the pool gone")
        await kv.put(node_key("worker", "new", "smollm2"), _value("new"))  # anyone speaks
        await eventually(lambda: holds(view.serves("smollm2") is True), 5, "the new one seen")
        assert not view.silent
    finally:
        await models.close()
        await view.stop()
        await workers.close()


def _ids(view: NodeView) -> set[str]:
    return {info.node_id for info in view.askable()}


async def test_a_stopping_worker_that_still_answers_is_counted_out(
    settings: MeshSettings, conn: Connection
) -> None:
    """A worker draining its last answer still answers "are you there?" (its registry entry's
    delete may have been lost: the edge then asks it). It says it is stopping, and the edge
    counts it out of the pool. Before, its answer counted as a heartbeat and kept it live while
    it took no more work."""
    model = settings.edge.cloud_model
    backend = DeterministicBackend(ModelSettings(backend="deterministic", token_delay_ms=100))
    async with (
        Connection(settings.nats, "worker") as wconn,
        Worker(settings, wconn, backend) as worker,
        MeshClient(settings=settings) as client,
    ):
        view = NodeView(conn, 30.0, pool=model)
        await view.start()
        models = CloudModels(conn, settings.stream, view, "scope-a")
        try:
            answering = asyncio.ensure_future(client.complete("x", max_tokens=30, via="cloud"))
            await eventually(lambda: holds(backend.started == 1), what="the answer under way")
            assert not await models._is_gone(worker.node_id)  # there, taking work
            stopping = asyncio.ensure_future(worker.stop())
            await eventually(lambda: holds(worker._stopping), what="the worker stopping")
            assert await models._is_gone(worker.node_id)
            answer = await asyncio.wait_for(answering, 30)  # drained, whole
            assert answer.text == expected_text("t", 30)
            await stopping
        finally:
            await view.stop()
