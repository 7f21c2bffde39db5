"""A request's deadline bounds it, whatever path it takes: at an edge (a local answer that would
run past it, a wait for a local slot, a cloud call: one bound in one place, ``Record.expire_at``)
and in the SDK (a worker generating on, an edge nobody answers for). Past it the client gets
one typed ``deadline_exceeded`` at the deadline (the tokens it had stay what they were), not a
complete answer seconds later and not silence."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from protocol.errors import DeadlineExceededError
from protocol.messages import TokenEvent
from tests.helpers import eventually, queue_drained, stat_reaches

LATE_S = 0.5
"""How far past its deadline a request may end here (a loaded 2-core machine)."""


def ended_at(deadline: float, what: str) -> None:
    """The request ended now: at its deadline, give or take what a loaded machine adds."""
    late = time.time() - deadline
    print(f"\n{what}: ended {late * 1000:+.0f} ms from its deadline")
    assert -0.05 < late < LATE_S, late


async def started_edge(settings: MeshSettings, conn: Connection, **model: float) -> EdgeNode:
    settings.edge.http_port = -1
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=1, **model))
    edge = EdgeNode(settings, conn, backend, HeuristicRouter())
    await edge.start()
    return edge


async def test_a_local_answer_that_would_outrun_its_deadline_ends_in_a_typed_error_at_it(
    settings: MeshSettings, conn: Connection
) -> None:
    """200 tokens at 20 ms each take 4 s; the deadline is 1 s away. A client streaming as the
    ``nats`` CLI would (JSON, its own inbox, so nothing of the SDK's own bound plays a part) gets
    the tokens made by then, in order, then ``deadline_exceeded`` from the edge at the deadline;
    then the edge answers the next request in full (the slot was given back)."""
    edge = await started_edge(settings, conn, token_delay_ms=20)
    try:
        inbox = conn.nc.new_inbox()
        events: asyncio.Queue[dict[str, object]] = asyncio.Queue()

        async def got(msg: Msg) -> None:
            await events.put(json.loads(msg.data))

        sub = await conn.nc.subscribe(inbox, cb=got)
        deadline = time.time() + 1.0
        body = {"prompt": "[tag:d] a long story", "route": "local", "max_tokens": 200}
        body |= {"stream": True, "deadline": deadline}
        await conn.nc.publish(edge.subject, json.dumps(body).encode(), reply=inbox)
        tokens: list[int] = []
        while (event := await asyncio.wait_for(events.get(), 5))["t"] in ("start", "tok"):
            if event["t"] == "tok":
                tokens.append(int(event["seq"]))  # type: ignore[call-overload]
        ended_at(deadline, "a local answer (nats CLI)")
        assert (event["t"], event["code"]) == ("err", "deadline_exceeded"), event
        assert 0 < len(tokens) < 200 and tokens == list(range(len(tokens)))
        assert edge.stats.get("error.deadline_exceeded") == 1
        await sub.unsubscribe()
        async with MeshClient(settings=settings) as client:
            after = await client.complete("[tag:e] short", route="local", max_tokens=3)
        assert after.path == "local" and after.end.usage.completion_tokens == 3
    finally:
        await edge.stop(grace=0)


async def test_a_request_waiting_for_a_local_slot_ends_at_its_deadline(
    settings: MeshSettings, conn: Connection
) -> None:
    """The only local slot is held by an answer that never ends; a request that must answer
    locally, sent as the ``nats`` CLI sends (JSON, a reply subject), waits for the slot until its
    deadline and is then told so, instead of waiting on."""
    edge = await started_edge(settings, conn)
    try:
        hung = asyncio.create_task(
            conn.nc.request(edge.subject, b'{"prompt": "[hang] hold it", "route": "local"}', 30)
        )

        async def holding() -> bool:
            return len(edge.tasks) == 1

        await eventually(holding, what="the hung request holding the slot")
        deadline = time.time() + 1.0
        body = {"prompt": "hi", "route": "local", "max_tokens": 2, "deadline": deadline}
        reply = await conn.nc.request(edge.subject, json.dumps(body).encode(), timeout=5)
        ended_at(deadline, "a local slot wait (nats CLI)")
        event = json.loads(reply.data)
        assert (event["t"], event["code"]) == ("err", "deadline_exceeded"), event
        hung.cancel()
    finally:
        await edge.stop(grace=0)


async def test_the_sdk_via_the_cloud_ends_at_the_deadline_and_the_worker_stops(
    settings: MeshSettings, conn: Connection
) -> None:
    """A worker would take 4 s over the answer; the deadline is 1 s away. The SDK raises
    ``deadline_exceeded`` at it and withdraws the request: the worker stops generating and lets
    it go, completing nothing."""
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", name=settings.worker.model.name, token_delay_ms=20)
    )
    async with Worker(settings, conn, backend) as worker, MeshClient(settings=settings) as client:
        deadline = time.time() + 1.0
        with pytest.raises(DeadlineExceededError):
            await client.complete(
                "[tag:c] a long story", via="cloud", max_tokens=200, deadline=deadline
            )
        ended_at(deadline, "SDK via the cloud")

        async def stopped() -> bool:  # told by the SDK's withdraw, or by its own clock first
            return worker.stats.cancelled + worker.stats.failed == 1

        await eventually(stopped, what="the worker to stop the answer")
        await eventually(lambda: queue_drained(conn, settings), what="the request acked")
        assert worker.stats.completed == 0


async def test_the_sdk_via_an_edge_nobody_serves_ends_at_the_deadline(
    settings: MeshSettings,
) -> None:
    """No edge listens under the id the client asks: it sends again for a while (an edge may be
    restarting), but not past the request's deadline."""
    async with MeshClient(settings=settings, edge_id="nobody-here") as client:
        deadline = time.time() + 1.0
        with pytest.raises(DeadlineExceededError):
            await client.complete("hi", max_tokens=2, deadline=deadline)
        ended_at(deadline, "SDK via an edge nobody serves")


async def test_the_sdk_via_the_cloud_ends_at_the_deadline_when_jetstream_does_not_answer(
    nats_server: NatsServer,
) -> None:
    """The client's link starts swallowing what it sends (a half-open link: no error, no reply),
    so the queue's ack never comes: each JetStream call would wait out its own timeout (5 s),
    but the request ends at its 1 s deadline."""
    from tests.conftest import make_settings

    proxy = await TcpProxy(nats_server.port).start()
    try:
        settings = make_settings(proxy.url)
        async with MeshClient(settings=settings) as client:
            proxy.swallow()
            deadline = time.time() + 1.0
            with pytest.raises(DeadlineExceededError):
                await client.complete("hi", via="cloud", max_tokens=2, deadline=deadline)
            ended_at(deadline, "SDK, link swallowing")
            assert proxy.swallowed, "nothing was swallowed: the test proves nothing"
    finally:
        await proxy.stop()


async def test_a_worker_stops_an_answer_at_its_deadline_for_a_client_that_queued_it_directly(
    settings: MeshSettings, conn: Connection
) -> None:
    """A request queued straight into the work queue (nothing of an edge's or the SDK's bound
    in play), whose answer would take 4 s with a 1 s deadline: the worker stops the engine at
    the deadline, publishes ``deadline_exceeded`` after the tokens so far, and lets the message
    go; nothing is completed."""
    from mesh.queue import CloudCall
    from protocol.messages import EndEvent, ErrorEvent, InferRequest
    from protocol.subjects import DEFAULT_SCOPE

    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", name=settings.worker.model.name, token_delay_ms=20)
    )
    scope = settings.nats.scope_or(DEFAULT_SCOPE)
    async with Worker(settings, conn, backend) as worker:
        deadline = time.time() + 1.0  # from when the worker is up
        request = InferRequest(
            prompt="[tag:q] a long story",
            max_tokens=200,
            model=settings.worker.model.name,
            deadline=deadline,
        )
        seen: list[object] = []
        async with CloudCall(conn, settings.stream, request, scope=scope) as call:
            while not any(isinstance(e, (EndEvent, ErrorEvent)) for e in seen):
                assert time.time() < deadline + 5, f"no outcome: {seen[-3:]}"
                seen += await call.reader.next(1.0)
            ended_at(deadline, "queued directly")
        outcome = seen[-1]
        assert isinstance(outcome, ErrorEvent) and outcome.code == "deadline_exceeded", outcome
        tokens = [e for e in seen if isinstance(e, TokenEvent)]
        assert 0 < len(tokens) < 200
        await stat_reaches(worker.stats, "failed", 1)
        await eventually(lambda: queue_drained(conn, settings), what="the request let go")
        assert worker.stats.completed == 0


async def test_an_edge_whose_link_stops_carrying_its_writes_ends_a_cloud_request_at_its_deadline(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection
) -> None:
    """The edge's own link starts swallowing what the edge sends (a half-open link): a request
    still reaches it, but its queueing of the request would wait out JetStream's 5 s ack. The
    request ends at its 1 s deadline all the same (counted at the edge: its reply cannot leave),
    instead of falling back to a local answer 5 s in."""
    from tests.conftest import make_settings

    proxy = await TcpProxy(nats_server.port).start()
    edge_settings = make_settings(proxy.url)
    edge_settings.edge.cloud_min_budget = 0.2  # 1 s is time enough to try the cloud
    worker_backend = DeterministicBackend(
        ModelSettings(backend="deterministic", name=settings.worker.model.name)
    )
    try:
        async with (
            Worker(settings, conn, worker_backend),
            Connection(edge_settings.nats, "edge") as edge_conn,
        ):
            edge = await started_edge(edge_settings, edge_conn)
            try:

                async def worker_seen() -> bool:
                    return edge.nodes.serves(settings.worker.model.name) is True

                await eventually(worker_seen, what="the edge to see the worker")
                async with MeshClient(settings=edge_settings) as client:  # a cloud answer first
                    warm = await client.complete("[tag:w] x", route="cloud", max_tokens=2)
                assert warm.path == "cloud"
                proxy.swallow()
                deadline = time.time() + 1.0
                body = {"prompt": "[tag:y] x", "route": "cloud", "max_tokens": 2}
                body |= {"deadline": deadline}
                await conn.nc.publish(
                    edge.subject, json.dumps(body).encode(), reply=conn.nc.new_inbox()
                )
                while edge.stats.get("error.deadline_exceeded") == 0:
                    assert time.time() < deadline + 6, edge.stats._counts
                    await asyncio.sleep(0.005)
                ended_at(deadline, "edge, its link swallowing")
                assert proxy.swallowed, "nothing was swallowed: the test proves nothing"
                proxy.cut(0)  # a link that drops, then carries again: the edge stops quickly
            finally:
                await edge.stop(grace=0)
    finally:
        await proxy.stop()
