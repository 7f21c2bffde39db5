"""Healing after faults, measured from where a user looks (a worker's status, an edge's
``/ready``, the queue's consumer). Times come from ``time.monotonic`` and are held to the
project's rule: a step is restored well under a second after its cause is gone, and readiness
says so as promptly. Review S27a wrote these; each failed before its fix (the docstrings say
what a user saw):

- a worker said ``unannounced`` for up to a heartbeat after its restore had announced it again
  (only the heartbeat loop cleared the mark: ``mesh.registry.Heartbeat``);
- an edge's ``/ready`` said "cannot tell" for a whole heartbeat after every blip of its link
  (it waited for the workers' next heartbeats instead of asking them:
  ``edge_node.served.CloudModels.live``);
- a consumer deleted again and again came back later each time, the pause doubled per word
  heard of one loss instead of per loss (``mesh.recovery``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.registry import live_workers
from mesh.testing.proxy import TcpProxy
from protocol.subjects import consumer_name
from tests.conftest import make_settings
from tests.helpers import eventually, holds

HEALED_WITHIN_S = 1.0
"""How long after its cause is gone a fault may still show (docs/reliability.md)."""


def _backend(slots: int = 2, name: str = "smollm2") -> DeterministicBackend:
    return DeterministicBackend(ModelSettings(backend="deterministic", name=name, slots=slots))


@pytest.fixture
async def proxied(nats_server: NatsServer) -> AsyncIterator[TcpProxy]:
    proxy = await TcpProxy(nats_server.port).start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def test_a_worker_says_ok_as_soon_as_its_restore_announced_it_again(
    own_server: NatsServer,
) -> None:
    """The hub's server dies and comes back on its store. While it is down the worker's
    heartbeat fails, and its status says ``health: unannounced`` (right). The reconnect's
    restore step announces the worker again at once (its entry is in the registry, edges see
    it), but only the heartbeat loop's own next beat clears the ``unannounced`` mark.

    What a user sees: ``mesh status`` (and ``nats micro stats``) goes on saying
    ``unannounced`` for up to a whole heartbeat interval after the worker is back in the
    registry: with ``heartbeat`` 3 s, about 2.5 s of a worker that reads as unseen by edges
    while every edge sees it. It should say ``ok`` once the restore's announcement succeeded."""
    settings = make_settings(own_server.url, stream__heartbeat=3.0, stream__node_ttl=9.0)
    settings.nats.reconnect_wait = 0.1
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "operator") as op,
        Worker(settings, wconn, _backend()) as worker,
    ):

        async def announced() -> bool:
            with contextlib.suppress(Exception):
                return any(w.node_id == worker.node_id for w in await live_workers(op))
            return False

        await eventually(announced, what="the worker in the registry")
        await own_server.kill()
        await eventually(
            lambda: holds(worker._heartbeat.failing), timeout=10, what="a heartbeat failed"
        )
        await own_server.restart()
        await eventually(lambda: holds(wconn.connected), what="the worker reconnected")
        await eventually(
            lambda: holds(not wconn.restoring), timeout=10, what="the worker's restore done"
        )
        await eventually(announced, timeout=10, what="the worker back in the registry")
        back = time.monotonic()
        seen: list[str] = []

        async def ok() -> bool:
            seen.append(worker.status()["health"])
            return bool(seen[-1] == "ok")

        await eventually(ok, timeout=10, what="health ok")
        took = time.monotonic() - back
        print(f"\nback in the registry; health ok {took:.2f} s later; seen {sorted(set(seen))}")
        assert took < HEALED_WITHIN_S, (took, sorted(set(seen)))


async def test_an_edge_is_ready_again_promptly_after_its_link_is_cut_for_2_s(
    settings: MeshSettings, conn: Connection, proxied: TcpProxy
) -> None:
    """An edge's link is cut for 2 s (a network blip); the worker and the hub stay up. The edge
    reconnects, reads the registry again (the worker's entry is there, written a moment ago)
    and its recovery steps end within milliseconds. But its registry view trusts nothing it
    read for a ``node_ttl`` after a reconnect (``NodeView.ready``), and ``serves`` says "cannot
    tell" until the worker's next heartbeat is heard: the edge waits out the heartbeat timer
    rather than asking the worker (it knows how: ``askable``, "are you there?").

    What a user (a load balancer probing ``/ready``, ``mesh status``) sees: the edge says
    ``degraded`` ("cannot tell yet whether a worker serves 'smollm2'") for up to a whole
    heartbeat after every reconnect, while the worker never went anywhere: 0.96 s measured with
    the default 1 s heartbeat, about 1.9 s with ``heartbeat`` 2 s as here. It should be ready
    again well under a second after the link is back."""
    settings.stream.heartbeat, settings.stream.node_ttl = 2.0, 6.0
    edge_settings = settings.model_copy(deep=True)
    edge_settings.nats.url = proxied.url
    edge_settings.nats.reconnect_wait = 0.1
    async with (
        Worker(settings, conn, _backend()),
        Connection(edge_settings.nats, "edge") as econn,
        EdgeNode(edge_settings, econn, _backend(name="local"), HeuristicRouter()) as edge,
    ):

        async def ready() -> bool:
            return bool((await edge.readiness())["status"] == "ready")

        await eventually(ready, what="the edge ready")
        proxied.cut(2.0)
        await eventually(lambda: holds(not econn.connected), what="the edge cut off")
        await eventually(lambda: holds(econn.connected), timeout=10, what="the edge reconnected")
        back = time.monotonic()
        seen: list[str] = []

        async def ready_again() -> bool:
            r = await edge.readiness()
            seen.append(r["reason"])
            return bool(r["status"] == "ready")

        await eventually(ready_again, timeout=10, what="the edge ready again")
        took = time.monotonic() - back
        print(f"\nedge ready again {took:.2f} s after its reconnect; said {sorted(set(seen))}")
        assert took < HEALED_WITHIN_S, (took, sorted(set(seen)))


async def test_a_queue_consumer_deleted_again_and_again_is_each_time_back_within_a_second(
    settings: MeshSettings, conn: Connection
) -> None:
    """An operator (or a tool) deletes the pool's consumer, and deletes it again a second after
    each time it is back. Each deletion is one loss, but the worker hears it several times
    (JetStream's advisory, and its open pull requests ending ``409 Consumer Deleted``), and
    ``Recovery.again`` counts every word heard within 2 s of the last restore as a flap:
    the pause before the next restore doubles per word, not per loss (0.1, 0.2 then 0.4,
    0.8 then 1.6 s...).

    What a user sees: the queue's consumer stays gone, the worker pulls nothing and says
    ``restoring``, and requests wait, for longer after each deletion: 1.6 s or more at the
    fourth. Each deletion's cause ends at once; each should be healed within a second."""
    async with Worker(settings, conn, _backend()) as worker:
        jsm = conn.jsm()
        name = consumer_name(worker.backend.model)

        async def present() -> bool:
            try:
                await jsm.consumer_info(settings.stream.name, name, timeout=0.5)
            except Exception:
                return False
            return True

        healed: list[float] = []
        for _ in range(4):
            await jsm.delete_consumer(settings.stream.name, name)
            gone = time.monotonic()
            await eventually(present, timeout=10, what="the consumer back")
            healed.append(round(time.monotonic() - gone, 2))
            await asyncio.sleep(1.0)  # the deletion again, a second after it is back
        print(f"\nconsumer back after each deletion: {healed} s")
        assert max(healed) < HEALED_WITHIN_S, healed
