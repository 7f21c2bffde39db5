"""An edge whose start fails undoes what it started before the error goes on: nobody answers for
it on NATS any more (a client hears "no responders" at once instead of waiting on an edge that
is not there), and nothing of it keeps running in the process."""

from __future__ import annotations

import socket

import nats.errors
import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.metrics import exposition
from mesh_app.local import LocalMesh
from protocol.errors import UnavailableError
from protocol.subjects import edge_infer_subject, edge_resend_subject
from tests.helpers import eventually, still_running, tasks_now


async def test_an_edge_whose_http_port_is_taken_leaves_nothing_open(
    settings: MeshSettings,
) -> None:
    """The HTTP API starts last, after the NATS intake opened: its port taken, the start fails,
    saying so and what sets the port, and the intake it had opened is closed again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings.edge.http_host = "127.0.0.1"
        settings.edge.http_port = taken.getsockname()[1]
        settings.edge.model.backend = "deterministic"
        conn = await Connection(settings.nats, "edge-port-taken").connect()
        try:
            before = await tasks_now(conn)
            model = DeterministicBackend(settings.edge.model)
            edge = EdgeNode(settings, conn, model, HeuristicRouter())
            with pytest.raises(UnavailableError) as raised:
                await edge.start()
            port = settings.edge.http_port
            said = raised.value.message
            assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in said, said
            assert "MESH_EDGE_HTTP_PORT" in said, said
            assert not edge.accepting
            edge_id = settings.edge.edge_id
            for subject in (edge_infer_subject(edge_id), edge_resend_subject(edge_id)):
                with pytest.raises(nats.errors.NoRespondersError):
                    await conn.nc.request(subject, b"{}", timeout=5)

            async def stopped() -> bool:
                return not still_running(before)

            await eventually(
                stopped, what=f"the failed start's tasks to end: {still_running(before)}"
            )
        finally:
            await conn.close()


async def test_a_started_edge_answers_on_the_subjects_the_failed_one_left(
    settings: MeshSettings,
) -> None:
    """The check above can fail: an edge that started answers there (a request it cannot
    read, with its typed error)."""
    settings.edge.model.backend = "deterministic"
    conn = await Connection(settings.nats, "edge-started").connect()
    edge = EdgeNode(settings, conn, DeterministicBackend(settings.edge.model), HeuristicRouter())
    try:
        await edge.start()
        reply = await conn.nc.request(edge_infer_subject(settings.edge.edge_id), b"{}", timeout=5)
        assert b"invalid_request" in reply.data, reply.data
    finally:
        await edge.stop()
        await conn.close()


def test_a_metrics_port_taken_is_said_plainly() -> None:
    """``mesh worker`` and ``mesh edge`` serve their metrics page before the node starts: a port
    taken there is the same typed error, naming what sets it (not the socket's traceback)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UnavailableError) as raised:
            exposition.serve(port, host="127.0.0.1", setting="MESH_WORKER_METRICS_PORT")
    said = raised.value.message
    assert f"metrics page cannot listen on 127.0.0.1:{port}" in said, said
    assert "MESH_WORKER_METRICS_PORT" in said, said


async def test_mesh_up_with_a_port_taken_says_which_and_leaves_nothing(
    settings: MeshSettings, conn: Connection
) -> None:
    """`mesh up` serves the worker's metrics page before its nodes start: that port taken, its
    start fails naming the setting, and undoes what it started (its connection, its engines)."""
    mesh = await _started_with_the_worker_port_taken(settings)
    assert mesh.conn is None and mesh.worker is None and mesh.edge is None


async def test_mesh_up_whose_undo_fails_too_raises_the_start_error_and_stops_the_rest(
    settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of the undo that fails (an engine that cannot close) neither hides why the start
    failed nor leaves the steps after it undone: the connection is closed all the same."""

    async def cannot_close(self: DeterministicBackend) -> None:
        raise RuntimeError("engine would not close")

    closed: list[Connection] = []
    close = Connection.close

    async def recorded(self: Connection) -> None:
        closed.append(self)
        await close(self)

    monkeypatch.setattr(DeterministicBackend, "close", cannot_close)
    monkeypatch.setattr(Connection, "close", recorded)
    mesh = await _started_with_the_worker_port_taken(settings)
    assert len(closed) == 1 and not closed[0].connected
    assert mesh.conn is None and mesh.worker is None and mesh.edge is None


async def _started_with_the_worker_port_taken(settings: MeshSettings) -> LocalMesh:
    """A `mesh up` (deterministic engines) whose worker metrics port is taken: its start fails,
    naming the setting."""
    settings.worker.model.backend = "deterministic"
    settings.edge.model.backend = "deterministic"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings.worker.metrics_port = taken.getsockname()[1]
        mesh = LocalMesh(settings)
        with pytest.raises(UnavailableError) as raised:
            await mesh.start()
    assert "MESH_WORKER_METRICS_PORT" in raised.value.message, raised.value.message
    return mesh
