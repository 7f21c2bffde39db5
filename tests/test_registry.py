"""The node registry (KV mesh_nodes): workers announce, edges see who is alive."""

from __future__ import annotations

import asyncio

from cloud_node.worker import Worker
from edge_node.served import CloudModels
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.node_view import NodeView
from tests.helpers import eventually


async def _serves(view: NodeView, model: str, expected: bool | None) -> bool:
    return view.serves(model) is expected


async def test_edge_view_follows_worker_start_stop_and_crash(
    settings: MeshSettings, conn: Connection, worker_backend: LlamaCppBackend
) -> None:
    settings.stream.heartbeat = 0.3
    settings.stream.node_ttl = 1.0
    view = NodeView(conn, settings.stream.node_ttl)
    await view.start()
    try:
        await eventually(lambda: _serves(view, "smollm2", False), what="an empty registry")

        async with Worker(settings, conn, worker_backend) as worker:
            await eventually(lambda: _serves(view, "smollm2", True), what="worker announced")
            (info,) = view.live()
            assert info.node_id == worker.node_id and info.models == ["smollm2"]
            assert info.slots == 1 and info.free == 1
            assert view.serves("other-model") is False
        await eventually(lambda: _serves(view, "smollm2", False), what="clean stop withdrawn")

        # A crash: the connection drops, no goodbye. The entry goes stale after node_ttl; with
        # nothing else heard from the registry, the view cannot tell a dead fleet from a silent
        # registry until it has looked at the registry (it works: the silence is the worker's)
        # or asked the worker (the server says nobody listens for it), whichever comes first.
        crash_conn = await Connection(settings.nats, "crashing").connect()
        crashing = Worker(settings, crash_conn, worker_backend)
        await crashing.start()
        await eventually(lambda: _serves(view, "smollm2", True), what="second worker announced")
        assert crashing._heartbeat._task is not None
        crashing._heartbeat._task.cancel()  # the process "dies": no more heartbeats
        await crash_conn.nc.close()
        await eventually(
            lambda: _serves(view, "smollm2", None), timeout=5, what="crashed worker to go stale"
        )
        models = CloudModels(conn, settings.stream, view, "scope-a")
        try:
            assert models.live("smollm2") is None  # asks the workers it aged out
            await eventually(
                lambda: _serves(view, "smollm2", False), timeout=5, what="the crash proven"
            )
        finally:
            await models.close()
        await crashing.stop()
    finally:
        await view.stop()
        await asyncio.sleep(0)


async def test_mesh_status_shows_workers_edges_capacity_and_the_queue(
    settings: MeshSettings, conn: Connection, worker_backend: LlamaCppBackend, edge: object
) -> None:
    from mesh.status import collect_status, render

    async with Worker(settings, conn, worker_backend) as worker:
        status = await collect_status(conn, settings)
    assert [w["node_id"] for w in status["workers"]] == [worker.node_id]
    assert status["workers"][0]["slots"] == 1 and "completed" in status["workers"][0]
    assert status["capacity"] == {"slots": 1, "free": 1}
    assert [e["edge_id"] for e in status["edges"]] == [settings.edge.edge_id]
    assert status["edges"][0]["status"] in {"ready", "degraded", "starting"}
    assert status["edges"][0]["counters"]["budget"]["policy"] == "share"  # the learned router
    queue = status["queue"]
    assert queue["stream"] == "MESH_INFER" and queue["waiting"] == 0
    assert queue["consumers"][0]["name"] == "workers_smollm2"
    assert queue["consumers"][0]["unacked"] == 0
    assert status["pools"] == {
        "smollm2": {"workers": 1, "slots": 1, "free": 1, "waiting": 0, "in_flight": 0}
    }
    text = "\n".join(render(status))
    assert "pool smollm2: 1 workers" in text
    assert worker.node_id in text and "queue MESH_INFER" in text and "workers_smollm2" in text
    assert settings.edge.edge_id in text


async def test_an_edge_follows_its_own_pool_only(settings: MeshSettings, conn: Connection) -> None:
    """Each worker's heartbeat reaches the edges of its model's pool, not every edge."""
    from mesh.registry import Heartbeat, NodeInfo

    def info(node: str, model: str) -> NodeInfo:
        return NodeInfo(node_id=node, role="worker", models=[model], slots=2, free=2)

    pool_a = NodeView(conn, 3.0, pool="big")
    everyone = NodeView(conn, 3.0)
    beats = [
        Heartbeat(conn, lambda: info("wa", "big"), 0.3, 3.0),
        Heartbeat(conn, lambda: info("wb", "small"), 0.3, 3.0),
    ]
    for beat in beats:
        await beat.start()
    await pool_a.start()
    await everyone.start()
    try:
        await eventually(lambda: _serves(pool_a, "big", True), what="pool big seen")
        await eventually(lambda: _serves(everyone, "small", True), what="pool small seen")
        await asyncio.sleep(1.0)  # a few more heartbeats of both pools
        assert [i.node_id for i in pool_a.live()] == ["wa"]  # wb's never reached it
        assert sorted(i.node_id for i in everyone.live()) == ["wa", "wb"]
        assert pool_a.serves("small") is None  # not its pool: it cannot tell, and says so
        assert pool_a.is_live("wa", "big") is True and pool_a.is_live("wb", "small") is None
        assert everyone.is_live("wb", "small") is True
    finally:
        for beat in beats:
            await beat.stop()
        await pool_a.stop()
        await everyone.stop()
