"""Regressions and holes in three fixes of issue 25's thirty-third stop, found in review S18c:
bae7a54 (hand-back of unstarted deliveries after a reconnect), d67c6c1 (observability under
hostile input) and 3f3219e (MeshClient.close()).

Each test marked "Before the fix" failed on the commit it names (the docstring says what
happened then); GUARD marks one that passed there too and keeps what was found sound."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
import structlog

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient, Via
from mesh.config import LogSettings, MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.logs import configure_logging, merge_bound
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from protocol.errors import MeshError, UnavailableError
from protocol.messages import TokenEvent
from protocol.subjects import consumer_name
from tests.conftest import linked_settings, make_settings
from tests.helpers import eventually, holds, serving, still_running, tasks_now
from tests.nats_wire import RawNatsClient


def _model(settings: MeshSettings, **kw: Any) -> ModelSettings:
    return ModelSettings(backend="deterministic", name=settings.worker.model.name, **kw)


async def _ack_pending(conn: Connection, settings: MeshSettings) -> int:
    info = await conn.jsm().consumer_info(
        settings.stream.name, consumer_name(settings.worker.model.name)
    )
    return info.num_ack_pending or 0


async def _settled(conn: Connection, settings: MeshSettings) -> bool:
    return await _ack_pending(conn, settings) == 0


# -- 1. bae7a54: hand_back_unstarted --------------------------------------------------------


@pytest.mark.parametrize("max_deliver", [3, 1])
async def test_a_reconnecting_worker_leaves_a_slow_linked_workers_held_delivery_alone(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
    max_deliver: int,
) -> None:
    """Before the fix (bae7a54). Worker B is on a slow return path (a remote site: what the
    server sends it arrives 2.5 s late). A request is delivered to B; B holds it, its start is
    on its way. Worker A's link drops for 0.2 s and comes back: A looked twice, 0.5 s apart, at
    the consumer's unacked messages, found B's delivery with nothing stored, and naked it by
    stream sequence. On its last delivery (max_deliver=1) JetStream gave it up at the nak, and
    the client got a max_deliveries error (about one run in three) for a request B was serving.

    Now a queue that delivers once is never swept (max_deliver=1: nothing handed back, one
    generation). With more deliveries, a delivery on a link slower than the grace (1 s) cannot
    be told from a lost one, and is taken over: the trade-off kept, since a message with
    nothing stored was delivered once, so the hand-back is never the last delivery; the request
    may be generated twice, and its client gets one correct answer."""
    proxy_a = await TcpProxy(nats_server.port).start()
    proxy_b = await TcpProxy(nats_server.port).start()
    settings = make_settings(nats_server.url)
    settings.stream.max_deliver = max_deliver
    asettings = linked_settings(proxy_a.url)
    bsettings = linked_settings(proxy_b.url)
    for s in (asettings, bsettings):
        s.stream.max_deliver = max_deliver
    a_backend = DeterministicBackend(_model(settings, slots=1))
    b_backend = DeterministicBackend(_model(settings, slots=1))
    try:
        async with (
            Connection(bsettings.nats, "worker-b") as bconn,
            Worker(bsettings, bconn, b_backend),
            MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
        ):
            await bconn.nc.flush()
            await asyncio.sleep(0.3)  # B's pull request is at the server
            proxy_b.delay_down = 2.5  # from now on B hears the server 2.5 s late
            asking = asyncio.ensure_future(
                client.complete("[tag:s] x", via="cloud", max_tokens=3, deadline=time.time() + 20)
            )
            await eventually(lambda: _ack_pending(conn, settings), 5, "delivered to B")
            async with (
                Connection(asettings.nats, "worker-a") as aconn,
                Worker(asettings, aconn, a_backend) as a,
            ):
                await aconn.nc.flush()
                proxy_a.cut(0.2)
                await eventually(lambda: holds(aconn.reconnects >= 1), 5, "A's link back")
                try:
                    answer = await asyncio.wait_for(asking, 15)
                except MeshError as err:
                    pytest.fail(
                        f"the client got {err.code.value}: {err} for a request worker B held "
                        f"(A handed back {a.orphans.handed_back})"
                    )
                assert answer.text == " s0 s1 s2"
                await eventually(lambda: holds(b_backend.started >= 1), 8, "B's generation")
                await eventually(
                    lambda: _settled(conn, settings), 8, "the request acked and settled"
                )
                proxy_b.delay_down = 0  # B stops promptly
                generated = a_backend.started + b_backend.started
                if max_deliver == 1:
                    assert (a.orphans.handed_back, generated) == (0, 1), (
                        f"worker A handed back B's held delivery ({a.orphans.handed_back}): "
                        f"the request was generated {generated} times"
                    )
    finally:
        await proxy_a.stop()
        await proxy_b.stop()


# -- 3. 3f3219e / 3bcae77: MeshClient.close() ----------------------------------------------


def _engine(delay_ms: int = 50) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=64, token_delay_ms=delay_ms, faults=False)
    )


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_closing_twice_at_once_still_takes_every_call_back(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Before the fix (3f3219e). Two closes at once (an ``async with`` exit and a shutdown hook,
    ``gather(client.close(), client.close())``): the first takes the calls in flight and starts
    their take-backs (an edge cancel, a cloud withdraw); the second finds none, and closes the
    client's own connection at once, under the first one's take-backs. Each take-back then
    fails on the closed connection, silently: the engine generates every abandoned answer to
    its end (10 answers x 100 tokens x 50 ms here: 5 s of 10 slots for nobody), as before the
    fix. Now both wait for the one close: the take-backs done before the connection goes. Via
    the cloud it failed (the withdraw's addressed cancel is a request, awaited); via the edge
    it passed (GUARD: the cancel is a buffered publish, flushed by the connection's close)."""
    settings.edge.max_concurrent = 256
    engine = _engine()
    node, kw = serving(via, settings, conn, engine)
    started = [asyncio.Event() for _ in range(10)]
    async with node:
        client = await MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10
        ).connect()

        async def one(i: int) -> None:
            async for event in client.stream(f"[tag:d{i}] x", max_tokens=100, via=via, **kw):
                if isinstance(event, TokenEvent):
                    started[i].set()

        tasks = [asyncio.ensure_future(one(i)) for i in range(10)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            assert engine._busy == 10
            await asyncio.wait_for(asyncio.gather(client.close(), client.close()), 5)
            ended = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            assert all(isinstance(e, MeshError) for e in ended), ended
            await eventually(
                lambda: holds(engine._busy == 0),
                timeout=2,
                what=f"the engine to stop the abandoned answers (busy {engine._busy})",
            )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_close_from_inside_the_stream_loop_ends_it_typed_and_takes_it_back(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """Before the fix via the cloud (3f3219e; minor, typed); GUARD via the edge. The caller closes
    the client from inside its own ``async for`` (its own task, a common pattern: "stop after
    N tokens"). close() returns promptly and the engine stops. But via the cloud the loop then
    ended in CancelledByClientError ("cancelled: cancelled"), not the documented UnavailableError
    ("the client was closed", docs/sdk.md): close() awaited the withdraw, the worker's
    cancelled error came into the reader's buffer meanwhile, and AnswerReader.next passed on
    what it held before the end close() set. Now the end close() set comes first."""
    engine = _engine()
    node, kw = serving(via, settings, conn, engine)
    async with node:
        before = await tasks_now(conn)
        client = await MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10
        ).connect()
        took: list[float] = []

        async def read_and_close() -> None:
            async for event in client.stream("[tag:c] x", max_tokens=100, via=via, **kw):
                if isinstance(event, TokenEvent) and not took:
                    began = time.monotonic()
                    await asyncio.wait_for(client.close(), 5)
                    took.append(time.monotonic() - began)

        with pytest.raises(UnavailableError):
            await read_and_close()
        assert took and took[0] < 2.0, took
        await eventually(
            lambda: holds(engine._busy == 0), 2, f"the engine to stop ({engine._busy})"
        )
        await eventually(lambda: holds(not still_running(before)), 3, "the client's tasks to end")


@pytest.mark.parametrize("via", ["edge", "cloud"])
async def test_close_ends_each_call_in_flight_in_unavailable_as_documented(
    settings: MeshSettings, conn: Connection, via: Via
) -> None:
    """GUARD (3f3219e). docs/sdk.md: closing the client with calls in flight (from another
    task) "ends each in UnavailableError": so it does, via the edge and via the cloud."""
    settings.edge.max_concurrent = 256
    engine = _engine()
    node, kw = serving(via, settings, conn, engine)
    started = [asyncio.Event() for _ in range(5)]
    async with node:
        client = await MeshClient(
            settings=settings, first_event_timeout=10, idle_timeout=10
        ).connect()

        async def one(i: int) -> None:
            async for event in client.stream(f"[tag:e{i}] x", max_tokens=100, via=via, **kw):
                if isinstance(event, TokenEvent):
                    started[i].set()

        tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
        try:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            await asyncio.wait_for(client.close(), 5)
            ended = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    said = [f"{type(e).__name__}: {e}" for e in ended]
    assert all(isinstance(e, UnavailableError) for e in ended), said


# -- 2. d67c6c1: trace context end to end --------------------------------------------------

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_a_valid_traceparent_under_another_header_case_reaches_edge_and_worker_logs(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before the fix (d67c6c1 kept it; older than it). HTTP header names are case-insensitive, and
    Go's net/http (every OpenTelemetry-Go client) sends ``Traceparent``. The edge's HTTP API
    kept the name as sent (trace_headers kept the key's case), then looked it up as
    ``traceparent`` (edge_node/node.py serve, cloud_node/serve.py _serving): a valid W3C
    context was carried to the worker but neither the edge's request line nor the worker's
    lines carried its trace_id over NATS (with OTel on, extract() missed it the same way).
    Now trace_headers names them in lower case."""
    settings.strict_decode = False
    settings.edge.http_port = 0
    settings.edge.model.backend = "deterministic"
    settings.edge.model.faults = False
    settings.worker.model.backend = "deterministic"
    settings.worker.model.name = "org/cloud-only"
    async with (
        Worker(settings, conn, DeterministicBackend(settings.worker.model)),
        EdgeNode(
            settings, conn, DeterministicBackend(settings.edge.model), HeuristicRouter()
        ) as edge,
    ):
        assert edge.http is not None
        assert await edge.models.deployed("org/cloud-only")
        configure_logging(LogSettings(level="info"))
        try:
            with structlog.testing.capture_logs([merge_bound]) as logs:
                for how in ("http", "nats"):
                    if how == "http":
                        async with aiohttp.ClientSession() as web:
                            body = {
                                "model": "org/cloud-only",
                                "messages": [{"role": "user", "content": "[tag:g] hi"}],
                                "max_tokens": 2,
                            }
                            async with web.post(
                                f"{edge.http.url}/v1/chat/completions",
                                json=body,
                                headers={"Traceparent": TRACEPARENT},
                            ) as resp:
                                assert resp.status == 200
                                answer = await resp.json()
                        assert answer["choices"][0]["message"]["content"] == " g0 g1"
                    else:
                        raw = await RawNatsClient().connect(settings.nats.url or "")
                        try:
                            reply = await raw.request(
                                edge.subject,
                                b'{"prompt": "[tag:g] hi", "model": "org/cloud-only", '
                                b'"max_tokens": 2}',
                                timeout=10,
                                headers={"Traceparent": TRACEPARENT},
                            )
                        finally:
                            await raw.close()
                        assert reply.json().get("text") == " g0 g1", reply.json()
                await eventually(
                    lambda: holds(sum(e["event"] == "request done" for e in logs) == 2), 5, "worker"
                )
        finally:
            configure_logging(LogSettings(level="warning"))
    trace = TRACEPARENT.split("-")[1]
    canonical = [e for e in logs if e["event"] == "request" and e.get("node_id") == edge.node_name]
    done = [e for e in logs if e["event"] == "request done"]
    found = {
        "edge http": canonical[0].get("trace_id"),
        "worker http": done[0].get("trace_id"),
        "edge nats": canonical[1].get("trace_id"),
        "worker nats": done[1].get("trace_id"),
    }
    assert found == dict.fromkeys(found, trace), (
        f"a valid traceparent sent as 'Traceparent' left these trace_ids: {found}"
    )
