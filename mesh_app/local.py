"""The embedded local mesh: nats-server, one cloud worker and one edge node in one process.

``mesh up`` runs it in the foreground; ``mesh demo`` starts it, asks, and stops it. Shutdown is
ordered: the edge stops taking requests and drains, then the worker, then the engines, then the
NATS connection, and the nats-server last.

Prometheus metrics follow the standalone roles' settings. The edge's series are on its HTTP
API's ``/metrics`` (and on ``MESH_EDGE_METRICS_PORT`` when set), as ``mesh edge`` serves them.
The worker's are on ``MESH_WORKER_METRICS_PORT`` when set, as ``mesh worker`` serves them, and
then only there: the worker gets a page of its own, so that one scrape job per role sees each
series once. When it is not set (the default), the edge's page shows the worker's series too,
so that one scrape of `mesh up` sees everything. Both nodes share one NATS connection,
``mesh-local``, which each page reports once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends import Backend, create_backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.lifecycle import Lifecycle, start_or_undo
from mesh.logs import get_logger
from mesh.metrics import Exposition, exposition
from mesh.nats_server import NatsServer, NatsServerError
from mesh.tasks import TaskSet

log = get_logger(__name__)
SERVER_RESTART_FIRST_S = 0.1
SERVER_RESTART_MAX_S = 5.0
"""The pauses between tries to start the nats-server again, doubling (see
:meth:`LocalMesh._keep_server`)."""


class LocalMesh(Lifecycle):
    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.server: NatsServer | None = None
        self.conn: Connection | None = None
        self.worker: Worker | None = None
        self.edge: EdgeNode | None = None
        self._backends: list[Backend] = []
        self.worker_page: Exposition | None = None
        """The worker's own metrics page, when ``worker.metrics_port`` is set."""
        self.worker_metrics_port: int | None = None
        self.edge_metrics_port: int | None = None
        self._tasks = TaskSet("local-mesh")
        self.server_restarts = 0

    @property
    def nats_url(self) -> str:
        return self.settings.nats.url or ""

    async def start(self) -> LocalMesh:
        # A start that fails stops what it started; the start's error is the one raised.
        await start_or_undo(self._start(), self.stop, "local mesh")
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
        if self.server is not None:
            server = self.server
            self._tasks.supervise(lambda: self._keep_server(server), name="nats-server-watch")
        self.conn = await Connection(settings.nats, "mesh-local").connect()
        await asyncio.gather(worker_backend.start(), edge_backend.start())
        # Ports before nodes: a port in use fails `mesh up` before anything answers requests.
        if settings.worker.metrics_port >= 0:
            self.worker_page = Exposition()
            self.worker_metrics_port = self.worker_page.serve(
                settings.worker.metrics_port, setting="MESH_WORKER_METRICS_PORT"
            )
        if settings.edge.metrics_port >= 0:
            self.edge_metrics_port = exposition.serve(
                settings.edge.metrics_port, setting="MESH_EDGE_METRICS_PORT"
            )
        self.worker = Worker(settings, self.conn, worker_backend, metrics_page=self.worker_page)
        await self.worker.start()
        self.edge = EdgeNode(settings, self.conn, edge_backend, create_router(settings.edge.router))
        await self.edge.start()
        log.info("local mesh up", nats_url=self.nats_url, edge_subject=self.edge.subject)

    async def _keep_server(self, server: NatsServer) -> None:
        """The nats-server ended by nobody's stop (a crash, the OOM killer, a stray kill): say
        so with the end of its log, and start it again on its port and store until it is up;
        the nodes reconnect, and their recovery puts back what the server lost. Before,
        ``mesh up`` ran on with no server, its ``/ready`` 503 for good."""
        pause = SERVER_RESTART_FIRST_S
        while True:
            up_since = asyncio.get_running_loop().time()
            status = await server.exited()
            log.error("nats-server exited; starting it again", status=status, log=server.log_tail())
            if asyncio.get_running_loop().time() - up_since >= SERVER_RESTART_MAX_S:
                pause = SERVER_RESTART_FIRST_S  # it ran well: this end is a new one
            while True:
                await asyncio.sleep(pause)
                pause = min(pause * 2, SERVER_RESTART_MAX_S)
                try:
                    await server.restart()
                    break
                except (NatsServerError, OSError) as err:  # OSError: it could not be spawned
                    log.error("nats-server did not start again", error=repr(err), pause_s=pause)
            self.server_restarts += 1
            log.warning("nats-server started again", url=server.url, pid=server.pid)

    async def stop(self) -> None:
        """In order; a step that fails is logged and the next one still runs, so that a node
        that failed to stop leaves no connection, engine or nats-server behind."""
        await self._tasks.close()  # the nats-server stops now: nobody starts it again
        edge, worker, page, port = self.edge, self.worker, self.worker_page, self.edge_metrics_port
        if edge is not None:
            await _step("edge", edge.stop)
        if worker is not None:
            await _step("worker", worker.stop)
        if page is not None:
            await _step("worker metrics page", page.stop)
        if port is not None:
            await _step("edge metrics page", lambda: exposition.stop(port))
        for backend in self._backends:
            await _step("engine", backend.close)
        if self.conn is not None:
            await _step("connection", self.conn.close)
        if self.server is not None:
            await _step("nats-server", self.server.stop)
        self.edge = self.worker = self.conn = self.server = None
        self._backends = []
        self.worker_page = self.worker_metrics_port = self.edge_metrics_port = None

    def metrics_pages(self) -> list[tuple[str, str]]:
        """Whose Prometheus metrics are where: ``(nodes, URL or port)`` pairs, for the
        operator."""
        edge = "edge" if self.worker_page is not None else "edge and worker"
        pages = []
        if self.edge is not None and self.edge.http is not None:
            pages.append((edge, f"{self.edge.http.url}/metrics"))
        if self.edge_metrics_port is not None:
            pages.append((edge, f"port {self.edge_metrics_port}"))
        if self.worker_metrics_port is not None:
            pages.append(("worker", f"port {self.worker_metrics_port}"))
        return pages


async def _step(what: str, step: Callable[[], Awaitable[None] | None]) -> None:
    try:
        done = step()
        if done is not None:
            await done
    except Exception:
        log.exception("stopping the local mesh: a step failed; going on", step=what)
