"""Starting where JetStream does not answer yet (a 503: the server just started, or no JetStream
for the account): a worker, `mesh provision` and an edge site's streams ask again before they
give up, and then say why. A real nats-server, started without JetStream. And a worker's start
that fails further on undoes what it started."""

from __future__ import annotations

import asyncio
import sys
import time

import nats.errors
import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import NOT_ANSWERING_RETRY_S, PROVISION_TRIES, refused
from mesh.registry import Heartbeat
from protocol.errors import MeshTimeoutError, UnavailableError
from protocol.subjects import worker_status_subject
from tests.conftest import make_settings
from tests.helpers import eventually, still_running, tasks_now

TRIES_TAKE_S = sum(0.5 * n for n in range(1, PROVISION_TRIES))
"""The waits between PROVISION_TRIES asks, 0.5 s more apart each time (0.5 + 1.0 + 1.5 s)."""


def test_a_503_is_told_apart_from_a_refusal() -> None:
    not_yet = refused("stream MESH_INFER", ServiceUnavailableError())
    assert not_yet.retry_after == NOT_ANSWERING_RETRY_S
    assert "not answering" in not_yet.message and "503" in not_yet.message
    no = refused("stream MESH_INFER", APIError(code=400, description="bad config"))
    assert no.retry_after is None and no.message.endswith("bad config")


async def test_a_worker_asks_a_jetstream_that_does_not_answer_again_then_says_why(
    server_without_jetstream: NatsServer,
) -> None:
    settings = make_settings(server_without_jetstream.url)
    conn = await Connection(settings.nats, "starting-worker").connect()
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    began = time.monotonic()
    try:
        with pytest.raises(UnavailableError) as raised:
            await Worker(settings, conn, backend).start()
    finally:
        await conn.close()
    took = time.monotonic() - began
    assert "not answering" in raised.value.message, raised.value.message
    assert took >= TRIES_TAKE_S - 0.1, took


async def test_mesh_provision_asks_again_too_then_says_why(
    server_without_jetstream: NatsServer,
) -> None:
    """The operator's ``mesh provision`` (run just after the server, as a deployment script
    does) goes through the same retry as a worker's start; before, its first 503 ended it."""
    began = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh_app.cli",
        "provision",
        "--nats-url",
        server_without_jetstream.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 60)
    took = time.monotonic() - began
    assert proc.returncode == 1
    said = err.decode()
    assert "not answering" in said and "503" in said, said[-2000:]
    assert said.count("provisioning slow; trying again") == PROVISION_TRIES - 1, said[-2000:]
    assert took >= TRIES_TAKE_S - 0.1, took


async def test_an_edge_site_asks_its_leaf_again_then_says_why(
    server_without_jetstream: NatsServer,
) -> None:
    """An edge on a site (``hub_domain``) keeps requests that can wait in its leaf server's own
    JetStream: a leaf server that does not answer yet gets the same tries before the edge's
    start fails, saying why (before, the first 503 ended it)."""
    settings = make_settings(server_without_jetstream.url, nats__hub_domain="hub")
    conn = await Connection(settings.nats, "starting-edge").connect()
    model = DeterministicBackend(settings.edge.model)
    edge = EdgeNode(settings, conn, model, HeuristicRouter())
    began = time.monotonic()
    before = await tasks_now(conn)
    try:
        with pytest.raises(UnavailableError) as raised:
            await edge.start()
        took = time.monotonic() - began

        async def undone() -> bool:  # the registry view, started before the site, stopped
            return not still_running(before)

        await eventually(undone, what=f"the failed start's tasks to end: {still_running(before)}")
    finally:
        await conn.close()
    assert "not answering" in raised.value.message, raised.value.message
    assert took >= TRIES_TAKE_S - 0.1, took


async def test_a_worker_whose_start_fails_undoes_what_it_started(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that cannot announce itself in the registry (the announcement fails here, as it
    does when the registry's stream does not answer for three request timeouts) has subscribed
    and opened its micro service by then: its failed start closes them again, so nobody answers
    for a worker that is not there, and nothing of it keeps running."""

    async def cannot_announce(_heartbeat: Heartbeat) -> None:
        raise MeshTimeoutError("cannot announce this node (the test's fault)")

    monkeypatch.setattr(Heartbeat, "start", cannot_announce)
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    before = await tasks_now(conn)
    worker = Worker(settings, conn, backend)
    with pytest.raises(MeshTimeoutError):
        await worker.start()
    with pytest.raises(nats.errors.NoRespondersError):
        await conn.nc.request(worker_status_subject(worker.node_id), b"", timeout=5)

    async def undone() -> bool:
        return not still_running(before)

    await eventually(undone, what=f"the failed start's tasks to end: {still_running(before)}")


async def test_a_started_worker_answers_where_the_failed_one_left_nothing(
    settings: MeshSettings, conn: Connection
) -> None:
    """The check above can fail: a worker that started answers on its status subject."""
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    worker = Worker(settings, conn, backend)
    await worker.start()
    try:
        reply = await conn.nc.request(worker_status_subject(worker.node_id), b"", timeout=5)
        assert reply.data
    finally:
        await worker.stop()
