"""The deployment's NATS configuration (compose/nats/*.conf), run for real: a JetStream hub and an
edge site's leaf node. A worker on the hub serves an edge on the leaf through the leaf link."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from tests.conftest import make_settings
from tests.helpers import eventually

COMPOSE = Path(__file__).resolve().parent.parent / "compose"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _localize(conf: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in conf, f"compose config no longer contains {old!r}"
        conf = conf.replace(old, new)
    return conf


@pytest.fixture
async def hub_and_leaf(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, NatsServer]]:
    client_port, leaf_port, leaf_client_port = _free_port(), _free_port(), _free_port()
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        _localize(
            (COMPOSE / "nats/hub.conf").read_text(),
            {
                "port: 4222": f"port: {client_port}",
                "http_port: 8222": "http_port: -1",
                "store_dir: /data/jetstream": f"store_dir: {tmp_path / 'js'}",
                "port: 7422": f"port: {leaf_port}",
            },
        )
    )
    leaf_conf = tmp_path / "leaf.conf"
    leaf_conf.write_text(
        _localize(
            (COMPOSE / "nats/leaf.conf").read_text(),
            {
                "port: 4222": f"port: {leaf_client_port}",
                "nats-leaf://nats-hub:7422": f"nats-leaf://127.0.0.1:{leaf_port}",
            },
        )
    )
    hub = await NatsServer(config=str(hub_conf), port=client_port).start()
    leaf = await NatsServer(config=str(leaf_conf), port=leaf_client_port).start()
    try:
        assert leaf.log_path is not None

        async def linked() -> bool:
            return "Leafnode connection created" in leaf.log_path.read_text()  # type: ignore[union-attr]

        await eventually(linked, timeout=10, what="leaf node to connect to the hub")
        yield hub, leaf
    finally:
        await leaf.stop()
        await hub.stop()


async def test_edge_on_a_leaf_escalates_to_a_worker_on_the_hub(
    hub_and_leaf: tuple[NatsServer, NatsServer],
    worker_backend: LlamaCppBackend,
    edge_backend: LlamaCppBackend,
) -> None:
    hub, leaf = hub_and_leaf
    hub_settings = make_settings(hub.url)
    leaf_settings = make_settings(leaf.url)
    leaf_settings.edge.edge_id = "site1"
    async with (
        Connection(hub_settings.nats, "hub") as hub_conn,
        Connection(leaf_settings.nats, "leaf") as leaf_conn,
        Worker(hub_settings, hub_conn, worker_backend) as worker,
        EdgeNode(leaf_settings, leaf_conn, edge_backend, HeuristicRouter()),
        MeshClient(settings=leaf_settings) as client,
    ):
        await asyncio.sleep(0.2)  # let subscription interest propagate over the leaf link
        cloud = await client.complete("Say hi.", route="cloud", max_tokens=8, temperature=0)
        local = await client.complete("Say hi.", max_tokens=8, temperature=0)
    assert cloud.path == "cloud" and cloud.end.served_by == f"cloud:{worker.node_id}"
    assert cloud.end.fallback is None and cloud.text.strip()
    assert local.path == "local" and local.end.served_by == "edge:site1"


def test_compose_file_wires_the_services() -> None:
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats-hub", "vllm", "worker", "edge-nats", "edge"} <= set(services)
    worker_env = services["worker"]["environment"]
    assert worker_env["MESH_NATS_URL"] == "nats://nats-hub:4222"
    assert worker_env["MESH_WORKER_MODEL_BASE_URL"] == "http://vllm:8000/v1"
    assert services["edge"]["environment"]["MESH_NATS_URL"] == "nats://edge-nats:4222"
    assert (
        services["edge"]["environment"]["MESH_EDGE_CLOUD_MODEL"]
        == worker_env["MESH_WORKER_MODEL_NAME"]
    )
    # Every MESH_* variable the compose file sets is a real setting.
    from mesh.config import describe_settings

    known = {env for env, _d, _doc in describe_settings()}
    for service in services.values():
        for name in service.get("environment", {}):
            if name.startswith("MESH_"):  # other images (Grafana...) have settings of their own
                assert name in known, f"{name} is not a mesh setting"
