"""An edge site as deployed: its own leaf-node nats-server dialling the hub over TLS with the
edge's credentials (the configs `mesh creds` writes), the edge daemon and its apps on the leaf,
the worker on the hub. Real nats-server processes, no mocks."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh_app.creds import Minted, mint
from tests.helpers import eventually
from tests.test_security import Certs, certs, read_env  # noqa: F401 - certs is a fixture

SITES = ("site-a", "site-b")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Topology:
    tmp: Path
    minted: Minted
    certs: Certs
    hub: NatsServer
    leaf_port: int
    leaves: dict[str, NatsServer] = field(default_factory=dict)

    def hub_settings(self, user: str) -> MeshSettings:
        env = read_env(self.minted.out / f"{user}.env")
        return _settings(env, self.hub.url, MESH_NATS_TLS_CA_FILE=str(self.certs.ca))

    def site_settings(self, site: str, user: str = "edge") -> MeshSettings:
        """A process at the site: on the leaf, without credentials (the leaf carries them)."""
        env = read_env(self.minted.out / f"{user}-{site}.env")
        env.pop("MESH_NATS_CREDS_FILE")
        return _settings(env, self.leaves[site].url)

    async def start_leaf(self, site: str) -> NatsServer:
        port = free_port()
        conf = self.tmp / f"leaf-{site}.local.conf"
        text = self.minted.leaf_confs[site].read_text().replace("port: 4222", f"port: {port}")
        conf.write_text(text)
        leaf = await NatsServer(config=str(conf), port=port).start()
        self.leaves[site] = leaf
        assert leaf.log_path is not None
        log_path = leaf.log_path

        async def linked() -> bool:
            return "Leafnode connection created" in log_path.read_text()

        await eventually(linked, timeout=10, what=f"leaf {site} to connect to the hub")
        return leaf


def _settings(env: dict[str, str], url: str, **extra: str) -> MeshSettings:
    return load_settings(
        environ={
            **env,
            "MESH_NATS_URL": url,
            "MESH_NATS_CONNECT_TIMEOUT": "3",
            "MESH_NATS_REQUEST_TIMEOUT": "2",
            "MESH_WORKER_MODEL_BACKEND": "deterministic",
            "MESH_EDGE_MODEL_BACKEND": "deterministic",
            "MESH_WORKER_FETCH_TIMEOUT": "0.5",
            "MESH_EDGE_HTTP_PORT": "-1",
            **extra,
        }
    )


@pytest.fixture
async def topology(tmp_path: Path, certs: Certs) -> AsyncIterator[Topology]:  # noqa: F811
    leaf_port = free_port()
    minted = mint(
        tmp_path,
        edges=list(SITES),
        workers=["w1"],
        hub_leaf_url=f"nats-leaf://127.0.0.1:{leaf_port}",
        leaf_tls_ca=str(certs.ca),
    )
    tls = f'tls {{ cert_file: "{certs.cert}"\n key_file: "{certs.key}"\n timeout: 2 }}'
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "hub-js"}" }}\n'
        f'include "{minted.auth_conf.name}"\n{tls}\n'
        f"leafnodes {{ port: {leaf_port}\n {tls} }}\n"
    )
    async with NatsServer(config=str(hub_conf)) as hub:
        topo = Topology(tmp_path, minted, certs, hub, leaf_port)
        try:
            for site in SITES:
                await topo.start_leaf(site)
            yield topo
        finally:
            for leaf in topo.leaves.values():
                await leaf.stop()


@contextlib.asynccontextmanager
async def running_mesh(topo: Topology) -> AsyncIterator[None]:
    worker_settings = topo.hub_settings("worker-w1")
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        for site in topo.leaves:
            settings = topo.site_settings(site)
            econn = await stack.enter_async_context(Connection(settings.nats, f"edge-{site}"))
            local = DeterministicBackend(settings.edge.model)
            await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        yield


async def test_edges_on_their_leaf_nodes_escalate_to_the_hub_over_tls(topology: Topology) -> None:
    async with running_mesh(topology):
        # Someone at site B listens to every mesh subject on B's leaf, while A's answer streams.
        spy_settings = topology.site_settings("site-b")
        seen: list[str] = []

        async def record(msg: Msg) -> None:
            seen.append(msg.subject)

        async with Connection(spy_settings.nats, "spy") as spy:
            await spy.nc.subscribe("mesh.v1.tok.>", cb=record)
            await spy.nc.subscribe("_INBOX.>", cb=record)
            answers = []
            for site, tag in (("site-a", "a"), ("site-b", "b")):
                async with MeshClient(settings=topology.site_settings(site, "client")) as client:
                    answers.append(
                        await client.complete(f"[tag:{tag}] hi", route="cloud", max_tokens=25)
                    )
        for answer, tag in zip(answers, "ab", strict=True):
            assert answer.path == "cloud" and answer.end.served_by == "cloud:w1"
            assert answer.text == "".join(f" {tag}{i}" for i in range(25))
        # B's own answer reached B's leaf; nothing of A's ever crossed into it.
        assert any(s.startswith("mesh.v1.tok.site-b.") for s in seen)
        assert not any("site-a" in s for s in seen)
