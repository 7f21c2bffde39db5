"""The embedded local mesh: nats-server, one cloud worker and one edge node in one process.

``mesh up`` runs it in the foreground; ``mesh demo`` starts it, asks, and stops it. Shutdown is
ordered: the edge stops taking requests and drains, then the worker, then the engines, then the
NATS connection, and the nats-server last.
"""

from __future__ import annotations

import asyncio

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends import Backend, create_backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from mesh.nats_server import NatsServer

log = get_logger(__name__)


class LocalMesh(Lifecycle):
    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.server: NatsServer | None = None
        self.conn: Connection | None = None
        self.worker: Worker | None = None
        self.edge: EdgeNode | None = None
        self._backends: list[Backend] = []

    @property
    def nats_url(self) -> str:
        return self.settings.nats.url or ""

    async def start(self) -> LocalMesh:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start(self) -> None:
        settings = self.settings
        if settings.nats.url is None:
            self.server = await NatsServer(
                port=settings.nats.local_port, store_dir=settings.nats.store_dir
            ).start()
            settings = settings.model_copy(
                update={"nats": settings.nats.model_copy(update={"url": self.server.url})}
            )
            self.settings = settings
        worker_backend = create_backend(settings.worker.model)
        edge_backend = create_backend(settings.edge.model)
        self._backends = [worker_backend, edge_backend]
        self.conn = await Connection(settings.nats, "mesh-local").connect()
        await asyncio.gather(worker_backend.start(), edge_backend.start())
        self.worker = Worker(settings, self.conn, worker_backend)
        await self.worker.start()
        self.edge = EdgeNode(settings, self.conn, edge_backend, create_router(settings.edge.router))
        await self.edge.start()
        log.info("local mesh up", nats_url=self.nats_url, edge_subject=self.edge.subject)

    async def stop(self) -> None:
        if self.edge is not None:
            await self.edge.stop()
        if self.worker is not None:
            await self.worker.stop()
        for backend in self._backends:
            await backend.close()
        if self.conn is not None:
            await self.conn.close()
        if self.server is not None:
            await self.server.stop()
        self.edge = self.worker = self.conn = self.server = None
        self._backends = []
