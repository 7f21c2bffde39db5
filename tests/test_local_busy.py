"""A request the router keeps local while the local model has no room for it (every slot busy,
its wait queue full) goes to the cloud, not back to its client as ``overloaded``: before, an
edge answered 429 while its workers sat idle. Within the cloud budget's per-minute cap; past
it, or when the cloud cannot take it either, the answer is ``overloaded`` as before."""

from __future__ import annotations

import asyncio

import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import CloudBudget, HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.testing.chaos import expected_text
from protocol.errors import OverloadedError
from tests.helpers import eventually, holds

SHORT = "[tag:{}] count"  # the heuristic router keeps a prompt like this local


def _backend(slots: int, token_ms: int) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=slots, token_delay_ms=token_ms, faults=False)
    )


async def test_a_busy_local_model_sends_the_router_s_local_requests_to_the_cloud(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.local_queue = 0
    local, cloud = _backend(1, 50), _backend(4, 5)
    async with (
        Worker(settings, conn, cloud),
        EdgeNode(settings, conn, local, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        holding = asyncio.ensure_future(client.complete(SHORT.format("l0"), max_tokens=40))
        await eventually(lambda: holds(local.started == 1), what="the local slot taken")
        busy = await client.complete(SHORT.format("c1"), max_tokens=8)
        assert busy.text == expected_text("c1", 8)
        assert busy.end.path == "cloud"
        assert busy.end.routing is not None and "local model is busy" in busy.end.routing.reason
        assert not busy.end.routing.forced
        held = await asyncio.wait_for(holding, 20)
        assert held.text == expected_text("l0", 40) and held.end.path == "local"
        assert local.started == 1  # the busy one never waited for the local model

        # Forced local, it is the local model's or nothing: overloaded, as the client asked.
        holding = asyncio.ensure_future(client.complete(SHORT.format("l1"), max_tokens=40))
        await eventually(lambda: holds(local.started == 2), what="the local slot taken again")
        with pytest.raises(OverloadedError):
            await client.complete(SHORT.format("c2"), max_tokens=8, route="local")
        await asyncio.wait_for(holding, 20)


def test_the_busy_local_model_s_escalations_count_under_the_cap() -> None:
    budget = CloudBudget(share=0.2, cap_per_minute=2, clock=lambda: 1000.0)
    assert budget.mid_answer() and budget.local_busy()
    assert not budget.local_busy()  # the cap is reached: the request stays local (overloaded)
    snapshot = budget.snapshot()
    assert snapshot["local_busy"] == 1 and snapshot["mid_answer"] == 1
    assert snapshot["cap_used"] == 2
