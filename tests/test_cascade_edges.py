"""The edge's local answering and mid-answer escalation at their edges: an escalation whose
cloud leg fails finds its local slot taken, one made too late for the cloud would throw away a
local answer that fit the deadline, and a capped request that finds the local model busy was
counted twice. Each test failed on the code before its fix (a review of cascade.py/paths.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from types import SimpleNamespace

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.paths import Paths
from edge_node.router import CloudBudget
from edge_node.routing import create_router
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.client import MeshClient
from mesh.config import ConfidenceSettings, MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.messages import InferRequest, RouteDecision
from tests.helpers import eventually, holds


class LocalEngine(DeterministicBackend):
    """The edge's engine: tag ``L`` whatever the prompt says, fault directives ignored."""

    def __init__(self, slots: int = 2, token_ms: int = 0) -> None:
        super().__init__(
            ModelSettings(
                backend="deterministic",
                name="local-tiny",
                slots=slots,
                token_delay_ms=token_ms,
                faults=False,
            )
        )

    def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        retagged = request.model_copy(update={"prompt": f"{request.prompt} [tag:L]"})
        return super().generate(retagged, prefix=prefix, prefix_tokens=prefix_tokens)


def cloud(token_ms: int = 0) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", name="smollm2", slots=2, token_delay_ms=token_ms)
    )


def cascade_settings(settings: MeshSettings, **confidence: object) -> MeshSettings:
    settings.edge.router.threshold = 1.0  # the router keeps everything local
    settings.edge.router.confidence = ConfidenceSettings(enabled=True, **confidence)  # type: ignore[arg-type]
    return settings


async def test_escalated_request_whose_cloud_leg_fails_is_answered_locally_not_overloaded(
    settings: MeshSettings, conn: Connection
) -> None:
    """docs/router.md: "If the cloud cannot take it, the local model answers afresh", even when
    the slot the escalation gave back was taken meanwhile and the queue is full. Before, the
    fallback queued like a new request, and was refused ``overloaded``."""
    cascade_settings(settings, window_tokens=3)
    settings.edge.local_queue = 0
    settings.edge.cloud_first_token_timeout = 1.0
    local = LocalEngine(slots=1, token_ms=50)
    async with (
        Worker(settings, conn, cloud()),  # the cloud's engine hangs on "[hang]"
        EdgeNode(settings, conn, local, create_router(settings.edge.router)),
        MeshClient(
            settings=settings, connection=conn, first_event_timeout=30, idle_timeout=30
        ) as client,
    ):
        unsure = asyncio.ensure_future(client.complete("[unsure] [hang] q", max_tokens=6))
        await eventually(lambda: holds(local.started == 1), what="the unsure local start")
        await eventually(lambda: holds(local.capacity().free == 1), what="its slot given back")
        sure = asyncio.ensure_future(client.complete("[tag:s] hello", max_tokens=60))
        await eventually(lambda: holds(local.started == 2), what="the sure request's slot")
        got = await asyncio.wait_for(unsure, 20)  # raises OverloadedError today
        assert got.text == Script(tag="L").answer(6) and got.end.path == "local"
        await asyncio.wait_for(sure, 20)


async def test_escalation_too_late_for_the_cloud_throws_away_an_answer_that_fit_the_deadline(
    settings: MeshSettings, conn: Connection
) -> None:
    """An unsure local answer whose deadline is by now too near for the cloud
    (``cloud_min_budget``) is kept. Before, the cascade checked the deadline only before the
    hold: it escalated, the relay refused the cloud at once ("deadline too near"), and the local
    model started the answer again from nothing, past the deadline, where the generation it
    dropped would have ended in time."""
    cascade_settings(settings, window_tokens=10)
    settings.edge.cloud_min_budget = 2.0
    local = LocalEngine(slots=1, token_ms=100)  # 20 tokens: about 1.9 s
    async with (
        Worker(settings, conn, cloud()),
        EdgeNode(settings, conn, local, create_router(settings.edge.router)) as edge,
        MeshClient(
            settings=settings, connection=conn, first_event_timeout=30, idle_timeout=30
        ) as client,
    ):
        got = await client.complete("[unsure] q", max_tokens=20, deadline=time.time() + 2.7)
        assert got.text == Script(tag="L").answer(20)  # DeadlineExceededError today
        assert local.started == 1
        budget = edge.budget
        assert budget is not None and budget.snapshot()["mid_answer"] == 0


def test_a_capped_request_finding_the_local_model_busy_counts_capped_once() -> None:
    """The router found the cap full and kept the request local (counted ``capped``); the local
    model is busy too. ``_busy_local`` asked the cap again, and counted it a second time in the
    budget's persisted totals."""
    budget = CloudBudget(share=0.5, threshold=0.1, cap_per_minute=0, clock=lambda: 1000.0)
    escalate, _, capped = budget.decide(0.9)  # the router wanted the cloud: capped
    assert not escalate and capped
    decision = RouteDecision(decision="local", reason="capped", budget=budget.snapshot(capped))
    paths = SimpleNamespace(  # what Paths._busy_local reads of its node
        _gate=SimpleNamespace(full=True), _es=SimpleNamespace(cloud_model="m"), budget=budget
    )
    req = InferRequest(prompt="x")
    assert Paths._busy_local(paths, req, decision) is None  # type: ignore[arg-type]
    assert budget.totals["capped"] == 1
