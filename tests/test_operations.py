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


async def test_refused_requests_are_counted_in_prometheus_as_in_mesh_status(
    web: aiohttp.ClientSession, ops_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    """HTTP 400s (bad JSON, a refused field, a bad value, flex without a site) and the NATS
    endpoint's bad_payload / invalid_request replies: each is a request that ended in an error,
    in ``mesh_edge_requests_total`` and ``mesh_edge_errors_total`` as in `mesh status --json`."""
    from mesh.status import collect_status
    from protocol.codec import decode_event

    body = {"messages": [{"role": "user", "content": "[tag:r] hi"}], "max_tokens": 2}
    over_http = [
        (b"{not json", "bad_payload"),
        (json.dumps({**body, "tools": [{"type": "function"}]}).encode(), "invalid_request"),
        (json.dumps({**body, "max_tokens": 0}).encode(), "invalid_request"),
        (json.dumps({**body, "service_tier": "flex"}).encode(), "invalid_request"),
    ]
    for payload, code in over_http:
        async with web.post(
            "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == code
    over_nats = [
        (b'{"prompt": "hi",,}', "bad_payload"),
        (b'{"prompt": "hi", "max_tokens": -1}', "invalid_request"),
    ]
    for payload, code in over_nats:
        reply = await conn.nc.request(ops_edge.subject, payload, timeout=5)
        assert decode_event(reply.data, reply.headers).code == code
    async with web.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200  # answered: not an error
    async with web.get("/metrics") as resp:
        page = await resp.text()
    errors = {"bad_payload": 2, "invalid_request": 4}
    assert {code: sample(page, "mesh_edge_errors_total", code=code) for code in errors} == errors
    failed = {"path": "none", "route": "none", "outcome": "error"}
    assert sample(page, "mesh_edge_requests_total", **failed) == 6
    assert sample(page, "mesh_edge_requests_total", path="local", route="auto", outcome="ok") == 1
    status = await collect_status(conn, settings)
    counters = next(e["counters"] for e in status["edges"] if e["edge_id"] == ops_edge.edge_id)
    assert {code: counters.get(f"error.{code}") for code in errors} == errors


async def test_micro_stats_count_each_endpoints_typed_errors(
    ops_edge: EdgeNode, conn: Connection
) -> None:
    """`nats micro stats mesh-edge`: ``num_errors`` and ``last_error`` of each endpoint count the
    typed errors it answered, whether refused at once or failed once served; the edge's
    counters are the ``data`` of ``infer`` alone."""
    from protocol.subjects import edge_answer_subject

    for payload in (
        b'{"prompt": "hi",,}',
        b'{"max_tokens": 3}',
        b'{"prompt": "hi", "max_tokens": -1}',
    ):
        reply = await conn.nc.request(ops_edge.subject, payload, timeout=5)
        assert reply.headers is not None and reply.headers["Nats-Service-Error-Code"] == "400"
    served = b'{"prompt": "hi", "model": "gpt-9-ultra"}'  # fails once served: no such pool
    reply = await conn.nc.request(ops_edge.subject, served, timeout=10)
    assert reply.headers is not None and reply.headers["Nats-Service-Error-Code"] == "404"
    reply = await conn.nc.request(ops_edge.subject, b'{"prompt": "[tag:s] hi"}', timeout=10)
    assert json.loads(reply.data)["t"] == "answer"
    kept = await conn.nc.request(edge_answer_subject(ops_edge.edge_id), b'{"id": "x"}', timeout=5)
    assert kept.headers is not None and kept.headers["Nats-Service-Error-Code"] == "503"
    assert ops_edge.intake.service is not None
    subject = f"$SRV.STATS.mesh-edge.{ops_edge.intake.service.id}"
    endpoints: dict[str, dict[str, object]] = {}

    async def counted() -> bool:
        stats = json.loads((await conn.nc.request(subject, b"", timeout=5)).data)
        endpoints.update({e["name"]: e for e in stats["endpoints"]})
        return endpoints["infer"]["num_errors"] == 4

    await eventually(counted, timeout=5, what="the infer endpoint's 4 errors")
    infer, answer = endpoints["infer"], endpoints["answer"]
    assert infer["num_requests"] == 5
    assert int(str(infer["processing_time"])) > 0  # the read loop's hand-off, timed as micro does
    # Taken in the read loop (mesh.inline_sub.make_inline): a nats-py that moved the micro
    # service's private parts would leave the endpoint on its callback, and fail here.
    infer_endpoint = ops_edge.intake._infer
    assert infer_endpoint is not None and infer_endpoint._subscription is not None
    assert infer_endpoint._subscription._pending_queue.empty()
    assert type(infer_endpoint._subscription._pending_queue).__name__ == "_Inline"
    assert str(infer["last_error"]).startswith("404:unknown_model: ")
    assert answer["num_requests"] == 1 and answer["num_errors"] == 1
    assert str(answer["last_error"]).startswith("503:unavailable: ")
    assert endpoints["cancel"]["num_errors"] == endpoints["resend"]["num_errors"] == 0
    data = infer["data"]
    assert isinstance(data, dict) and data["error.bad_payload"] == 1
    assert data["error.invalid_request"] == 2 and data["error.unknown_model"] == 1
    assert [endpoints[name]["data"] for name in ("cancel", "resend", "answer")] == [None] * 3
