"""The edge's NATS intake, taken in the connection's read loop (``edge_node.nats_intake``): a
request it cannot take is refused with a typed error, never left without a reply, whether the
edge is full or stopping."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from tests.helpers import eventually

HANG = b'{"prompt": "[hang] hold the only slot", "route": "local"}'
ASK = b'{"prompt": "hi", "route": "local", "max_tokens": 2}'


async def started_edge(settings: MeshSettings, conn: Connection) -> EdgeNode:
    settings.edge.http_port = -1
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=4))
    edge = EdgeNode(settings, conn, backend, HeuristicRouter())
    await edge.start()
    return edge


def error_of(data: bytes) -> tuple[str, str]:
    event = json.loads(data)
    assert event["t"] == "err", event
    return event["code"], event["message"]


async def test_requests_over_the_limit_and_while_stopping_get_a_typed_refusal(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.max_concurrent = 1
    edge = await started_edge(settings, conn)
    try:
        held = asyncio.create_task(conn.nc.request(edge.subject, HANG, timeout=30))

        async def holding() -> bool:
            return len(edge.tasks) == 1

        await eventually(holding, what="the hanging request in flight")
        refused = await asyncio.gather(
            *(conn.nc.request(edge.subject, ASK, timeout=5) for _ in range(8))
        )
        assert [error_of(r.data) for r in refused] == [
            ("overloaded", "edge is at its concurrency limit")
        ] * 8
        assert len(edge.tasks) == 1  # the refusals never counted toward the limit

        stopping = asyncio.create_task(edge.stop(grace=1.0))  # the hung request holds it 1 s

        async def not_accepting() -> bool:
            return not edge.accepting

        await eventually(not_accepting, what="the edge stopping")
        late = await conn.nc.request(edge.subject, ASK, timeout=5)
        # Before the fix: ("overloaded", "edge is stopping"), where HTTP said unavailable.
        assert error_of(late.data) == ("unavailable", "edge is shutting down")
        await stopping
        code, _message = error_of((await held).data)
        assert code == "unavailable"  # the hung request, cut off by the stop: told so
    finally:
        await edge.stop(grace=0)


async def test_an_intake_that_fails_answers_an_error_as_a_micro_service_would(
    settings: MeshSettings, conn: Connection
) -> None:
    """A bug in the read-loop intake (here: made to raise) still answers its client, with the
    500 nats-py's micro service sends for a handler that raises, and counts it in the stats."""
    edge = await started_edge(settings, conn)
    try:

        def broken(_request: object) -> None:
            raise RuntimeError("a bug in the intake")

        edge.intake.take = broken  # type: ignore[method-assign]
        reply = await conn.nc.request(edge.subject, ASK, timeout=5)
        assert reply.headers is not None
        assert reply.headers["Nats-Service-Error-Code"] == "500"
        assert "a bug in the intake" in reply.headers["Nats-Service-Error"]
        assert edge.intake.service is not None
        infer = next(e for e in edge.intake.service.stats().endpoints if e.name == "infer")
        assert (infer.num_requests, infer.num_errors) == (1, 1)
    finally:
        await edge.stop(grace=0)


async def test_the_limit_counts_http_and_nats_requests_together(
    settings: MeshSettings, conn: Connection
) -> None:
    """``max_concurrent`` bounds what the edge answers at once, whichever way it came: HTTP
    requests went uncounted, any number at once, and NATS ones did not see them."""
    settings.edge.max_concurrent = 2
    settings.edge.http_port = 0
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=4))
    chat = {"model": "auto", "messages": [{"role": "user", "content": "[hang] hold"}]}
    async with (
        EdgeNode(settings, conn, backend, HeuristicRouter()) as edge,
        aiohttp.ClientSession() as session,
    ):
        assert edge.http is not None
        url = f"{edge.http.url}/v1/chat/completions"
        held = [
            asyncio.create_task(session.post(url, json=chat, timeout=aiohttp.ClientTimeout(30)))
            for _ in range(2)
        ]

        async def holding() -> bool:
            return edge.http is not None and edge.http.answering() == 2

        await eventually(holding, what="two HTTP requests in flight")
        async with session.post(url, json=chat) as refused:
            assert refused.status == 429
            assert refused.headers["Retry-After"] == "1"
            body = await refused.json()
            assert body["error"]["code"] == "overloaded", body
        over_nats = await conn.nc.request(edge.subject, ASK, timeout=5)
        assert error_of(over_nats.data) == ("overloaded", "edge is at its concurrency limit")
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)

        async def freed() -> bool:
            return edge.http is not None and edge.http.answering() == 0

        await eventually(freed, what="the held requests gone")
        answered = await conn.nc.request(edge.subject, ASK, timeout=5)
        assert json.loads(answered.data)["t"] == "answer"


# Before the fix (first rule: never silence): an exception other than a MeshError while the
# intake read a request (before it is served) ended the request's task with a log line only; its
# sender heard nothing until its own timeout (20 s for the SDK waiting for the start). Review
# S19c met it through a defect of a fix under way; a defect of this kind is now told, typed.
async def test_a_defect_while_reading_a_request_is_told_not_silent(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    import edge_node.nats_intake

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a defect")

    edge = await started_edge(settings, conn)
    try:
        monkeypatch.setattr(edge_node.nats_intake, "decode_request", broken)
        reply = await conn.nc.request(edge.subject, ASK, timeout=5)
        assert error_of(reply.data) == ("internal", "the edge failed to read this request")
    finally:
        await edge.stop(grace=0)
