"""A small mesh per fault test: its own nats-server (file storage), real worker and edge
processes on the deterministic backend, optional proxies in front of the server."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.testing.chaos import (
    JsCluster,
    MeshProcess,
    Server,
    edge_env,
    wait_for_edge,
    wait_for_worker,
    worker_env,
)
from mesh.testing.proxy import TcpProxy


@dataclass
class Cluster:
    tmp: Path
    server: Server
    conn: Connection | None = None
    processes: list[MeshProcess] = field(default_factory=list)
    proxies: list[TcpProxy] = field(default_factory=list)
    clients: list[MeshClient] = field(default_factory=list)
    servers: list[asyncio.subprocess.Process] = field(default_factory=list)
    edge_id: str = ""

    def settings(self, url: str | None = None) -> MeshSettings:
        return load_settings(
            {("nats", "url"): url or self.server.url, ("edge", "edge_id"): self.edge_id},
            environ={},
        )

    async def proxy(self) -> TcpProxy:
        proxy = await TcpProxy(self.server.port).start()
        self.proxies.append(proxy)
        return proxy

    async def worker(
        self,
        node_id: str,
        *,
        url: str | None = None,
        backend_url: str | None = None,
        continuation: str = "vllm",
        extra_env: dict[str, str] | None = None,
        **kw: Any,
    ) -> MeshProcess:
        env = {**worker_env(url or self.server.url, node_id, **kw), **(extra_env or {})}
        if backend_url is not None:  # the OpenAI-HTTP backend in front of a server
            env.update(
                MESH_WORKER_MODEL_BACKEND="openai",
                MESH_WORKER_MODEL_BASE_URL=backend_url,
                MESH_WORKER_MODEL_CONTINUATION=continuation,
            )
        proc = await MeshProcess("worker", node_id, env, self.tmp / f"{node_id}.log").start()
        self.processes.append(proc)
        assert self.conn is not None
        await wait_for_worker(self.conn, node_id)
        return proc

    async def edge(self, *, url: str | None = None, **env: str) -> MeshProcess:
        merged = {**edge_env(url or self.server.url, self.edge_id), **env}
        proc = await MeshProcess("edge", self.edge_id, merged, self.tmp / "edge.log").start()
        self.processes.append(proc)
        assert self.conn is not None
        await wait_for_edge(self.conn, self.edge_id)
        return proc

    async def openai_server(self, token_ms: float = 10) -> str:
        """The deterministic OpenAI-compatible server, as a process; its base URL."""
        import sys

        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mesh.testing.openai_server",
            "--token-ms",
            str(token_ms),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self.servers.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        port = int(line.decode().split()[-1])
        return f"http://127.0.0.1:{port}/v1"

    async def client(self, url: str | None = None, **kw: Any) -> MeshClient:
        kw.setdefault("first_event_timeout", 30)
        kw.setdefault("idle_timeout", 30)
        client = MeshClient(settings=self.settings(url), edge_id=self.edge_id, **kw)
        await client.connect()
        self.clients.append(client)
        return client

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.role} {p.name} (pid {p.proc.pid if p.proc else '?'}):\n"
            + p.log_path.read_text(errors="replace")[-4000:]
            for p in self.processes
        )


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    server = Server(tmp_path / "store")
    await server.start()
    cluster = Cluster(tmp=tmp_path, server=server, edge_id=f"chaos{uuid.uuid4().hex[:6]}")
    cluster.conn = await Connection(cluster.settings().nats, "chaos-test").connect()
    try:
        yield cluster
    finally:
        for client in cluster.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 10)
        await asyncio.gather(*(p.stop() for p in cluster.processes), return_exceptions=True)
        for proxy in cluster.proxies:
            await proxy.stop()
        for proc in cluster.servers:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(cluster.conn.close(), 10)
        await server.stop()


@pytest.fixture
async def js_cluster(tmp_path: Path) -> AsyncIterator[JsCluster]:
    """A 3-node JetStream cluster of real nats-servers (routes between them)."""
    cluster = JsCluster(tmp_path)
    await cluster.start()
    try:
        yield cluster
    finally:
        await cluster.stop()
