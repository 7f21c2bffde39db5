"""A pool's only worker hangs with its link up (SIGSTOP here; a stuck engine call, a blocked loop
in life): its heartbeats stop, and since it was the only worker, the registry goes quiet as a
whole. The registry itself still works (its stream answers, with a leader, unsealed), so the
silence is the worker's own: the edge sees the pool without a live worker after its
``node_ttl`` and answers locally at once, and sends to the cloud again once the worker is back.
Before, a registry quiet as a whole read "cannot tell" until the server dropped the hung
worker's link (minutes with default pings): every escalation was queued for the hung worker and
answered locally only after ``cloud_start_timeout``. A registry that refuses writes while its
workers are fine stays "cannot tell" (``tests/test_lost_state.py``)."""

from __future__ import annotations

import time
from pathlib import Path

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import MeshProcess, expected_text, paused, worker_env
from tests.conftest import make_settings
from tests.helpers import eventually, holds


async def test_a_lone_hung_worker_is_not_waited_for(own_server: NatsServer, tmp_path: Path) -> None:
    settings = make_settings(own_server.url)
    worker = await MeshProcess(
        "worker", "w1", worker_env(own_server.url, "w1", slots=2), tmp_path / "w1.log"
    ).start()
    local = DeterministicBackend(ModelSettings(backend="deterministic", slots=1))
    model = settings.edge.cloud_model
    try:
        async with (
            Connection(settings.nats, "edge") as econn,
            EdgeNode(settings, econn, local, HeuristicRouter()) as edge,
            MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
        ):
            await eventually(
                lambda: holds(edge.nodes.serves(model) is True), 30, what="the worker seen"
            )
            answer = await client.complete("[tag:a] x", route="cloud", max_tokens=3)
            assert answer.path == "cloud" and answer.text == expected_text("a", 3)
            with paused(worker.pid):
                hung = time.monotonic()
                await eventually(
                    lambda: holds(edge.models.live(model) is False),
                    timeout=10,
                    what="the hung worker out of the view",
                )
                out = time.monotonic() - hung
                began = time.monotonic()
                answer = await client.complete("[tag:b] x", route="cloud", max_tokens=3)
                took = time.monotonic() - began
                assert answer.path == "local" and answer.text == expected_text("b", 3)
                assert "no live worker" in (answer.end.fallback or ""), answer.end.fallback
            print(
                f"\na lone worker hung: out of the view {out:.2f} s after (node_ttl "
                f"{settings.stream.node_ttl:g} s); the next request answered locally in "
                f"{took:.2f} s"
            )
            assert took < settings.edge.cloud_start_timeout / 2, took
            await eventually(
                lambda: holds(edge.nodes.serves(model) is True), 10, what="the worker back"
            )
            answer = await client.complete("[tag:c] x", route="cloud", max_tokens=3)
            assert answer.path == "cloud" and answer.text == expected_text("c", 3)
    finally:
        await worker.stop()
