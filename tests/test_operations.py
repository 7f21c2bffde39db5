"""What an operator checks: Prometheus metrics, readiness that means something, and every node
discoverable as a NATS micro service (what `nats micro ls` and `nats micro stats` show)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.metrics import exposition
from protocol.subjects import worker_status_subject
from tests.helpers import eventually, stat_reaches


def deterministic() -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", slots=2))


@pytest.fixture
async def ops_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    settings.edge.http_port = 0
    async with EdgeNode(settings, conn, deterministic(), HeuristicRouter()) as edge:
        yield edge


@pytest.fixture
async def web(ops_edge: EdgeNode) -> AsyncIterator[aiohttp.ClientSession]:
    assert ops_edge.http is not None
    async with aiohttp.ClientSession(base_url=ops_edge.http.url) as session:
        yield session


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text page (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([a-z_]+)(?:\{(.*)\})? (\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return 0.0


async def test_ready_says_degraded_without_workers_and_ready_with_one(
    web: aiohttp.ClientSession, ops_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    async with web.get("/health") as resp:
        assert resp.status == 200
    async with web.get("/ready") as resp:
        ready = await resp.json()
    assert resp.status == 200  # it can still answer, locally
    assert ready["status"] == "degraded", ready
    assert "no live worker serves" in ready["reason"]
    assert ready["checks"] == {
        "model": "loaded",
        "nats": "connected",
        "cloud": "unreachable",
        "intake": "open",
        "recovery": "restored",
    }
    async with Worker(settings, conn, deterministic()):

        async def is_ready() -> bool:
            async with web.get("/ready") as resp:
                ready.update(await resp.json())
            return bool(ready["status"] == "ready")

        await eventually(is_ready, timeout=5, what="the worker's heartbeat to reach the edge")
        assert ready["checks"]["cloud"] == "reachable" and ready["workers_alive"] == 1
    await ops_edge.stop()
    assert (await ops_edge.readiness())["status"] == "not_ready"


async def test_metrics_count_requests_latencies_tokens_and_reconnects(
    web: aiohttp.ClientSession, ops_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    async with (
        Worker(settings, conn, deterministic()) as worker,
        MeshClient(settings=settings, connection=conn) as client,
    ):
        await client.complete("[tag:m] hi", route="local", max_tokens=8)
        await client.complete("[tag:m] hi", route="cloud", max_tokens=8)
        await client.complete("[tag:m] hi", via="cloud", max_tokens=8)
        await stat_reaches(worker.stats, "completed", 2)  # counted once acked
        async with web.get("/metrics") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/plain"
            page = await resp.text()
    edge = {"path": "local", "route": "forced", "outcome": "ok"}
    assert sample(page, "mesh_edge_requests_total", **edge) == 1
    assert sample(page, "mesh_edge_requests_total", **{**edge, "path": "cloud"}) == 1
    assert sample(page, "mesh_edge_time_to_first_token_seconds_count", path="cloud") == 1
    assert sample(page, "mesh_edge_tokens_total", direction="out", path="local") == 8
    assert sample(page, "mesh_edge_route_decisions_total", decision="cloud", forced="true") == 1
    assert sample(page, "mesh_worker_requests_total", outcome="completed") == 2
    assert sample(page, "mesh_worker_queue_wait_seconds_count") == 2
    assert sample(page, "mesh_worker_tokens_total", direction="out") == 16
    assert sample(page, "mesh_worker_slots") == 2
    assert "mesh_nats_reconnects_total" in page
    # A worker alone serves the same page on a port of its own (MESH_WORKER_METRICS_PORT).
    port = exposition.serve(0, host="127.0.0.1")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as resp,
        ):
            assert "mesh_edge_requests_total" in await resp.text()
    finally:
        exposition.stop()


async def test_workers_and_edges_are_discoverable_micro_services(
    ops_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    settings.worker.node_id = "discoverable"
    async with Worker(settings, conn, deterministic()) as worker:
        info = json.loads((await conn.nc.request("$SRV.INFO.mesh-worker", b"", timeout=5)).data)
        assert info["name"] == "mesh-worker"
        assert info["metadata"]["model"] == worker.backend.model
        assert info["metadata"]["slots"] == "2"
        stats = json.loads((await conn.nc.request("$SRV.STATS.mesh-worker", b"", timeout=5)).data)
        assert stats["endpoints"][0]["data"]["free"] == 2
        status = json.loads(
            (await conn.nc.request(worker_status_subject("discoverable"), b"", timeout=5)).data
        )
        assert status["node_id"] == "discoverable" and status["slots"] == 2
    edge_info = json.loads((await conn.nc.request("$SRV.INFO.mesh-edge", b"", timeout=5)).data)
    assert edge_info["metadata"]["edge_id"] == ops_edge.edge_id
    assert edge_info["metadata"]["status"] in {"ready", "degraded"}


async def test_the_edge_keeps_and_exports_its_cloud_budget(
    settings: MeshSettings, conn: Connection, tmp_path: object
) -> None:
    from pathlib import Path

    from edge_node.routing import create_router

    state = Path(str(tmp_path)) / "budget.json"
    settings.edge.router.budget_state = str(state)
    settings.edge.http_port = -1
    router = create_router(settings.edge.router)
    long_prompt = "Please summarise this note. " + "The meeting is on Tuesday. " * 300
    async with (
        Worker(settings, conn, deterministic()),
        EdgeNode(settings, conn, deterministic(), router),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        for prompt in ("[tag:b] hello", "[tag:b] what is 2+2?", "[tag:b] thanks"):
            await client.complete(prompt, max_tokens=4)
        # Too long for the local model: escalated whatever the router says, counted apart.
        too_long = await client.complete(long_prompt, max_tokens=4)
        page = exposition.text().decode()
    assert too_long.end.routing is not None and too_long.end.routing.budget is not None
    assert too_long.end.routing.budget["forced_cloud"] == 1
    assert 0.0 <= sample(page, "mesh_edge_cloud_budget_share") <= 1.0
    assert sample(page, "mesh_edge_cloud_budget_threshold") == pytest.approx(router.threshold)
    saved = json.loads(state.read_text())  # written when the edge stopped
    assert saved["totals"]["auto"] == 3 and saved["totals"]["forced_cloud"] == 1
