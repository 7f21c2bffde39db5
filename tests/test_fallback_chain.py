"""An edge's chain of cloud pools (``cloud_fallbacks``) after the first pool's tokens reached the
client: the next pool's answer starts the answer over, it does not go on from the first's.

Each pool's worker numbers its attempts from 1 (its request is queued under a fresh id). Passed
on as they came, the second pool's start read as the first attempt again (dropped), its first
tokens as positions the client had (dropped), and the rest as the first pool's answer going on:
the client got "aa0 .. aa4 bb5 .. bb11" and then ``incomplete``, where the second pool had made a
whole, correct answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.provision import provision
from mesh.testing.chaos import expected_text
from protocol.messages import EndEvent, InferRequest, RestartEvent, TokenEvent


class OtherTag(DeterministicBackend):
    """The second pool: the same prompt, another text (``[tag:bb]``), so that whose tokens reach
    the client shows."""

    async def generate(  # type: ignore[override]
        self, request: InferRequest, **kwargs: Any
    ) -> AsyncIterator[Any]:
        other = request.model_copy(update={"prompt": "[tag:bb] count", "messages": None})
        async for chunk in super().generate(other, **kwargs):
            yield chunk


def _worker(settings: MeshSettings, conn: Connection, node: str, backend: Any) -> Worker:
    own = settings.model_copy(deep=True)
    own.worker.node_id = node
    own.worker.model.name = backend.model
    return Worker(own, conn, backend)


async def test_the_next_pool_starts_the_answer_over(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.cloud_model = "smollm2"
    settings.edge.cloud_fallbacks = ["other"]
    settings.worker.report_stall_after = 0.5  # the first pool's engine stands still: it says so
    await provision(conn.jsm(), settings.stream, ["smollm2", "other"])
    first = DeterministicBackend(
        ModelSettings(backend="deterministic", name="smollm2", slots=2, token_delay_ms=20)
    )
    second = OtherTag(
        ModelSettings(
            backend="deterministic", name="other", slots=2, token_delay_ms=20, faults=False
        )
    )
    local = DeterministicBackend(ModelSettings(backend="deterministic", slots=2, faults=False))
    prompt = "[tag:aa] [hang-after:5] count"
    async with (
        _worker(settings, conn, "pool-a", first),
        _worker(settings, conn, "pool-b", second),
        EdgeNode(settings, conn, local, HeuristicRouter()),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        events = [e async for e in client.stream(prompt, route="cloud", max_tokens=12)]
        restart = next(i for i, e in enumerate(events) if isinstance(e, RestartEvent))
        before = "".join(e.text for e in events[:restart] if isinstance(e, TokenEvent))
        after = "".join(e.text for e in events[restart:] if isinstance(e, TokenEvent))
        assert before == expected_text("aa", 5)  # the first pool's, as far as it went
        assert after == expected_text("bb", 12)  # then the second pool's whole answer
        end = events[-1]
        assert isinstance(end, EndEvent) and end.served_by == "cloud:pool-b"
        assert end.fallback is not None and "'other' pool after smollm2" in end.fallback

        # A client of the NATS request (as `nats req` sends it) gets the second pool's answer.
        body = json.dumps({"prompt": prompt, "route": "cloud", "max_tokens": 12}).encode()
        reply = await conn.nc.request(
            f"mesh.v1.edge.{settings.edge.edge_id}.infer", body, timeout=30
        )
        answer = json.loads(reply.data)
        assert answer["text"] == expected_text("bb", 12) and answer["served_by"] == "cloud:pool-b"
