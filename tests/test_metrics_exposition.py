"""The Prometheus page of `mesh up` is valid exposition: one family per name (one HELP and one
TYPE line), one sample per label set, even though the embedded worker and edge share one
process and one NATS connection; and the worker's series go to MESH_WORKER_METRICS_PORT when
that is set, as a standalone `mesh worker`'s do."""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.metrics import Exposition, NatsMetrics
from mesh_app.local import LocalMesh
from tests.helpers import scrape, stat_reaches

MESH = [sys.executable, "-m", "mesh_app.cli"]
ENV = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}


def assert_valid_exposition(page: str) -> dict[str, set[str]]:
    """Fails on a repeated HELP/TYPE line or a repeated (name, labels) sample; returns each
    family's sample names, as Prometheus' own parser reads the page."""
    lines = page.splitlines()
    meta = Counter(line for line in lines if line.startswith(("# HELP ", "# TYPE ")))
    assert not [line for line, n in meta.items() if n > 1], "repeated HELP/TYPE lines"
    series = Counter(line.rsplit(" ", 1)[0] for line in lines if line and line[0] != "#")
    assert not [s for s, n in series.items() if n > 1], "repeated samples"
    families: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(page):
        assert family.name not in families, f"family {family.name} twice"
        keys = [(s.name, tuple(sorted(s.labels.items()))) for s in family.samples]
        assert len(keys) == len(set(keys)), f"repeated samples in {family.name}"
        families[family.name] = {s.name for s in family.samples}
    return families


@pytest.fixture
async def local_mesh(settings: MeshSettings, conn: Connection) -> AsyncIterator[LocalMesh]:
    """`mesh up` in this process, on the session's nats-server, with scripted engines."""
    settings.worker.model.backend = "deterministic"
    settings.edge.model.backend = "deterministic"
    settings.edge.http_port = 0
    async with LocalMesh(settings) as mesh:
        yield mesh


async def test_mesh_up_page_has_each_family_and_series_once(local_mesh: LocalMesh) -> None:
    mesh = local_mesh
    assert mesh.edge is not None and mesh.edge.http is not None and mesh.worker is not None
    async with MeshClient(settings=mesh.settings) as client:
        await client.complete("hi", route="local", max_tokens=4)
        await client.complete("hi", route="cloud", max_tokens=4)
    await stat_reaches(mesh.worker.stats, "completed", 1)
    page = await scrape(f"{mesh.edge.http.url}/metrics")
    families = assert_valid_exposition(page)
    # Both nodes' series are there (no worker port is set), the shared connection once.
    assert {"mesh_edge_requests", "mesh_worker_requests", "mesh_worker_slots"} <= set(families)
    assert page.count('mesh_nats_reconnects_total{connection="mesh-local"}') == 1
    assert page.count('mesh_nats_message_losses_total{connection="mesh-local"}') == 1


async def test_the_page_shows_how_long_garbage_collections_stopped_the_process(
    local_mesh: LocalMesh,
) -> None:
    """A full collection stops every stream the process serves: each is timed, by generation,
    once on the page although both nodes of `mesh up` show it."""
    mesh = local_mesh
    assert mesh.edge is not None and mesh.edge.http is not None

    def full_collections(page: str) -> float:
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == "mesh_process_gc_pause_seconds_count" and sample.labels == {
                    "generation": "2"
                }:
                    return sample.value
        raise AssertionError("no mesh_process_gc_pause_seconds for generation 2 on the page")

    before = full_collections(await scrape(f"{mesh.edge.http.url}/metrics"))
    gc.collect()
    page = await scrape(f"{mesh.edge.http.url}/metrics")
    assert_valid_exposition(page)
    assert full_collections(page) >= before + 1  # ours (and any the process made meanwhile)


async def test_nats_collectors_report_each_connection_once(settings: MeshSettings) -> None:
    """Several nodes watching one connection report it once; distinct connections that share a
    name stay apart."""
    async with (
        Connection(settings.nats, "shared") as one,
        Connection(settings.nats, "shared") as other,
    ):
        page = Exposition()
        sources = [NatsMetrics() for _ in range(3)]
        for source, conn in zip(sources, (one, one, other), strict=True):
            source.watch(conn)
            page.add(source.registry)
        text = page.text().decode()
        assert_valid_exposition(text)
        labels = re.findall(r'mesh_nats_reconnects_total\{connection="([^"]+)"\}', text)
        assert labels == ["shared", "shared#2"]
        page.remove(sources[2].registry)
        labels = re.findall(
            r'mesh_nats_reconnects_total\{connection="([^"]+)"\}', page.text().decode()
        )
        assert labels == ["shared"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


@pytest.mark.slow
def test_mesh_up_serves_the_worker_on_mesh_worker_metrics_port() -> None:
    worker_port = _free_port()
    env = {
        **ENV,
        "MESH_WORKER_METRICS_PORT": str(worker_port),
        "MESH_WORKER_MODEL_BACKEND": "deterministic",
        "MESH_EDGE_MODEL_BACKEND": "deterministic",
    }
    up = subprocess.Popen(
        [*MESH, "up", "--port", "-1", "--http-port", "0", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(4)]
        out = "".join(lines)
        api = re.search(r"OpenAI-compatible API: (http://[\d.]+:\d+)/v1", out)
        assert api, (out, up.stderr.read() if up.poll() is not None else "")  # type: ignore[union-attr]
        worker_page = _get(f"http://127.0.0.1:{worker_port}/metrics")
        assert f"Prometheus metrics (worker): port {worker_port}\n" in out, out
        edge_page = _get(f"{api.group(1)}/metrics")
        worker = assert_valid_exposition(worker_page)
        edge = assert_valid_exposition(edge_page)
        assert {"mesh_worker_slots", "mesh_worker_requests", "mesh_nats_reconnects"} <= set(worker)
        assert not [name for name in worker if name.startswith("mesh_edge_")]
        assert {"mesh_edge_requests", "mesh_edge_live_workers", "mesh_nats_reconnects"} <= set(edge)
        assert not [name for name in edge if name.startswith("mesh_worker_")]
        up.terminate()
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_labelled_children_are_kept_and_count_as_before() -> None:
    """An edge's and a worker's labelled metrics hand out the same child for the same labels
    (looked up once); the page reads as prometheus-client writes it, and wrong labels are still
    refused."""
    from prometheus_client import generate_latest

    from mesh.metrics import EdgeMetrics, WorkerMetrics

    edge = EdgeMetrics()
    first = edge.requests.labels(path="cloud", route="auto", outcome="ok")
    assert edge.requests.labels(path="cloud", route="auto", outcome="ok") is first
    first.inc()
    edge.requests.labels(path="cloud", route="auto", outcome="ok").inc(2)
    edge.requests.labels("local", "forced", "ok").inc()
    edge.ttft.labels(path="cloud").observe(0.05)
    page = generate_latest(edge.registry).decode()
    assert 'mesh_edge_requests_total{outcome="ok",path="cloud",route="auto"} 3.0' in page
    assert 'mesh_edge_requests_total{outcome="ok",path="local",route="forced"} 1.0' in page
    assert 'mesh_edge_time_to_first_token_seconds_count{path="cloud"} 1.0' in page
    with pytest.raises(ValueError):
        edge.requests.labels(path="cloud")
    worker = WorkerMetrics()
    worker.requests.labels(outcome="completed").inc()
    assert worker.requests.labels(outcome="completed") is worker.requests.labels(
        outcome="completed"
    )
    assert (
        'mesh_worker_requests_total{outcome="completed"} 1.0'
        in generate_latest(worker.registry).decode()
    )
