"""The compose deployment's observability files stay true to the code: Prometheus scrapes the
ports the services expose their metrics on, and every metric the Grafana dashboard queries is
one the nodes really export. (Docker cannot run here; these are the checks that can.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.metrics import exposition

COMPOSE = Path(__file__).resolve().parent.parent / "compose"


def test_prometheus_scrapes_what_the_services_expose() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    scrape = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape["scrape_configs"]
    }
    worker_env = compose["services"]["worker"]["environment"]
    edge_env = compose["services"]["edge"]["environment"]
    assert targets["mesh-worker"] == f"worker:{worker_env['MESH_WORKER_METRICS_PORT']}"
    assert targets["mesh-edge"] == "edge:8080"  # the edge's HTTP API serves /metrics
    assert edge_env["MESH_EDGE_HTTP_HOST"] == "0.0.0.0"
    grafana = compose["services"]["grafana"]["volumes"]
    assert any("mesh-dashboard.json" in v for v in grafana)


async def test_every_dashboard_metric_is_exported(settings: MeshSettings, conn: Connection) -> None:
    dashboard = json.loads((COMPOSE / "grafana" / "mesh-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b(mesh_[a-z_]+)", e)}
    settings.edge.http_port = -1
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with (
        Worker(settings, conn, backend),
        EdgeNode(settings, conn, backend, HeuristicRouter()),
        MeshClient(settings=settings, connection=conn) as client,
    ):
        await client.complete("[tag:d] hi", route="cloud", max_tokens=4)
        page = exposition.text().decode()
    # Every declared metric (labelled ones print no sample until a label value is used).
    exported: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (mesh_\w+) (\w+)$", page, flags=re.M):
        exported.add(name)
        if kind == "histogram":
            exported.update(name + suffix for suffix in ("_bucket", "_count", "_sum"))
        if kind == "counter":
            exported.add(name.removesuffix("_total") + "_total")
    missing = sorted(m for m in queried if m not in exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    assert len(queried) >= 15
