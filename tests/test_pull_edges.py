"""A worker's back-pressure and pulling at their edges (cloud_node/puller.py, cloud_node/worker.py,
cloud_node/outcomes.py for an engine's 429/503). Real nats-server, the deterministic backend
paced like an engine, an aiohttp stand-in for an OpenAI-compatible engine.

Each test marked "Before the fix" failed on the code before it (review S17f); the docstring says
what happened then. GUARD: passed before too."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from aiohttp import web
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.hub import provision_hub
from mesh.nats_server import NatsServer
from mesh.provision import provision
from mesh.queue import publish_request
from mesh.testing.proxy import TcpProxy
from protocol.codec import decode_event
from protocol.errors import MeshError
from protocol.messages import EndEvent, ErrorEvent, InferRequest, TokenEvent
from protocol.subjects import DEFAULT_SCOPE, consumer_name, token_subject
from tests.conftest import linked_settings, make_settings
from tests.helpers import chat_backend, chat_server, eventually, holds, queue_drained


class Counting(DeterministicBackend):
    """The deterministic engine, noting the most generations it ran at once."""

    def __init__(self, settings: ModelSettings) -> None:
        super().__init__(settings)
        self.most = 0

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        inner = super().generate(request, prefix=prefix, prefix_tokens=prefix_tokens)
        first = True
        try:
            async for chunk in inner:
                if first:
                    self.most = max(self.most, self._busy)
                    first = False
                yield chunk
        finally:
            await inner.aclose()


def _model(settings: MeshSettings, **kw: Any) -> ModelSettings:
    return ModelSettings(backend="deterministic", name=settings.worker.model.name, **kw)


async def _stream_answer(request: web.Request, words: list[str]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for word in words:
        delta = {"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
        await response.write(b"data: " + json.dumps(delta).encode() + b"\n\n")
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    await response.write(b"data: " + json.dumps(end).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    return response


def _busy(retry_after: str) -> web.Response:
    return web.json_response(
        {"error": {"message": "busy", "type": "server_busy"}},
        status=429,
        headers={"Retry-After": retry_after},
    )


# -- 1. an engine that says "busy, retry after 1 s" uses up a request's deliveries -------------


async def test_an_engine_busy_for_a_moment_does_not_use_up_the_requests_deliveries(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """Before the fix. The engine answers its first three calls 429 Retry-After: 1 (busy
    with other tenants for ~2 s), then serves. The client's deadline is 20 s away. Each 429
    becomes a nak(delay=1) that costs one of max_deliver=3 deliveries, so the third 429 turns
    into a max_deliveries error after ~2 s, for a request that merely waited for room. A 429
    with Retry-After is back-pressure: the request should wait (held with progress, or handed
    back without counting) and be answered."""
    calls: list[float] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            return _busy("1")
        return await _stream_answer(request, [" fine", " now"])

    settings = make_settings(nats_server.url)
    async with chat_server(chat) as base:
        backend = chat_backend(settings.worker.model.name, base)
        await backend.start()
        try:
            async with (
                Connection(settings.nats, "worker") as wconn,
                Worker(settings, wconn, backend),
                MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
            ):
                try:
                    answer = await asyncio.wait_for(
                        client.complete("hi", via="cloud", max_tokens=8, deadline=time.time() + 20),
                        15,
                    )
                except MeshError as err:
                    pytest.fail(
                        f"a request that only waited for an engine saying 'retry after 1 s' "
                        f"failed: {err.code.value}: {err} (engine calls: {len(calls)})"
                    )
                assert answer.text == " fine now"
        finally:
            await backend.close()


# -- 2. while the engine says Retry-After, the worker keeps pulling work to burn ---------------


async def test_while_the_engine_says_retry_after_the_worker_pulls_no_more_work_to_burn(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """Before the fix. The engine answers 429 Retry-After: 5 to everything. A worker of one
    slot, six requests queued: after the first 429 the worker's slot is free again at once (the
    nak), so it pulls the next request and sends it to the engine too, and the next... Each
    request burns a delivery within a fraction of a second (and, in a fleet, a healthy worker's
    share goes to this one). Back-pressure would stop pulling for the Retry-After: at most one
    engine call per slot in the first 2 s."""
    calls: list[float] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        calls.append(time.monotonic())
        return _busy("5")

    settings = make_settings(nats_server.url)
    async with chat_server(chat) as base:
        backend = chat_backend(settings.worker.model.name, base)
        await backend.start()
        try:
            async with Connection(settings.nats, "ops") as conn:
                await provision(conn.jsm(), settings.stream, [settings.worker.model.name])
                for n in range(6):
                    request = InferRequest(
                        id=f"busy-{n}", prompt="hi", model=settings.worker.model.name, max_tokens=4
                    )
                    await publish_request(conn, settings.stream, request, scope=DEFAULT_SCOPE)
                async with (
                    Connection(settings.nats, "worker") as wconn,
                    Worker(settings, wconn, backend),
                ):
                    await eventually(lambda: holds(bool(calls)), 5, "the first engine call")
                    await asyncio.sleep(2.0)  # within the engine's Retry-After of 5 s
                    first = calls[0]
                    within = [c for c in calls if c - first < 2.0]
                    assert len(within) <= 1, (
                        f"{len(within)} engine calls within 2 s of a 429 'Retry-After: 5' on a "
                        "1-slot worker: each burned a request's delivery"
                    )
        finally:
            await backend.close()


# -- 3. a delivery lost in the worker's dying link waits out ack_wait ----------------------------


async def test_a_delivery_lost_in_the_workers_dying_link_is_served_promptly(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """The worker's link drops just as JetStream delivers it a request (the proxy throws away
    the piece holding the delivery and cuts for 0.3 s). The worker is back 0.1 s later, idle,
    pulling; the server counts the request delivered and unacked. Before the fix it gave it to
    nobody until ack_wait (5 s, the default) ran out: no start was ever written, so the orphan
    hand-back could not see it. Now the worker whose link came back looks at the queue's
    unacked messages twice, 1 s apart, and naks one with nothing stored of its answer
    (Orphans.hand_back_unstarted): answered 1.32 s after the cut here (0.82 s with the looks
    0.5 s apart, before review S18c: tests/test_fix_regressions_s18.py)."""
    proxy = await TcpProxy(nats_server.port).start()
    wsettings = linked_settings(proxy.url)
    wsettings.stream.ack_wait = 5.0  # the default
    settings = make_settings(nats_server.url)
    settings.stream.ack_wait = 5.0
    backend = DeterministicBackend(_model(settings, slots=2))
    try:
        async with (
            Connection(wsettings.nats, "worker") as wconn,
            Worker(wsettings, wconn, backend) as worker,
            MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
        ):
            await wconn.nc.flush()
            proxy.lose(f"$JS.ACK.{settings.stream.name}.".encode(), 0.3)
            began = time.monotonic()
            asking = asyncio.ensure_future(
                client.complete("[tag:l] x", via="cloud", max_tokens=3, deadline=time.time() + 20)
            )
            await eventually(lambda: holds(proxy.lost > 0), 5, "the delivery lost in the link")
            answer = await asyncio.wait_for(asking, 15)
            took = time.monotonic() - began
            print(f"\na delivery lost in the worker's link: answered after {took:.2f} s")
            assert answer.text == " l0 l1 l2"
            await eventually(lambda: holds(worker.stats.completed == 1), 5, "the ack")
            assert took < 2.5, (
                f"the request lost in the worker's dying link waited {took:.1f} s "
                "(ack_wait) while the worker sat idle"
            )
    finally:
        await proxy.stop()


async def test_a_worker_whose_link_came_back_hands_back_no_other_workers_answer(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """GUARD of the hand-back above. Worker B generates an answer (30 tokens, 50 ms apart);
    worker A's link drops for 0.3 s and comes back while it does. A looks at the queue's unacked
    messages and finds B's answer started in the store: it hands nothing back, and B's answer
    is generated once and read whole. Were A to hand back what it cannot tell from a lost
    delivery, B's request would come to A (A generating it too)."""
    proxy = await TcpProxy(nats_server.port).start()
    asettings = linked_settings(proxy.url)
    settings = make_settings(nats_server.url)
    a_backend = DeterministicBackend(_model(settings, slots=1))
    b_backend = DeterministicBackend(_model(settings, slots=1, token_delay_ms=50))
    try:
        async with (
            Connection(settings.nats, "worker-b") as bconn,
            Worker(settings, bconn, b_backend),
            MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
        ):
            asking = asyncio.ensure_future(
                client.complete("[tag:l] x", via="cloud", max_tokens=30, deadline=time.time() + 20)
            )
            await eventually(lambda: holds(b_backend.started == 1), 5, "B's answer under way")
            async with (
                Connection(asettings.nats, "worker-a") as aconn,
                Worker(asettings, aconn, a_backend) as a,
            ):
                await aconn.nc.flush()
                proxy.cut(0.3)
                await eventually(lambda: holds(aconn.reconnects >= 1), 5, "A's link back")
                answer = await asyncio.wait_for(asking, 15)
                assert answer.text == " " + " ".join(f"l{i}" for i in range(30))
                assert (b_backend.started, a_backend.started, a.orphans.handed_back) == (1, 0, 0)
    finally:
        await proxy.stop()


async def test_a_worker_back_from_a_cut_looks_only_past_its_last_delivery(
    settings: MeshSettings, conn: Connection
) -> None:
    """GUARD of the hand-back's narrowing (review S18c: a fleet back from a server's restart
    must not each read every answer in flight). Two requests are queued; a reader standing for
    a worker that stands still pulls both from the worker's consumer and starts neither (both
    pending, nothing stored). A worker whose last delivery was the first looks only past it:
    it hands back the second, not the first; JetStream delivers the second again at once."""
    await provision_hub(conn.jsm(), settings.stream, [settings.worker.model.name])
    scope, model = settings.nats.scope_or(DEFAULT_SCOPE), settings.worker.model.name
    for i in (1, 2):
        request = InferRequest(id=f"held-{i}", prompt="[tag:h] x", max_tokens=2, model=model)
        await publish_request(conn, settings.stream, request, scope=scope)
    consumer = consumer_name(model)
    held = await conn.js.pull_subscribe_bind(consumer, settings.stream.name)
    first, second = await held.fetch(2, timeout=5)
    backend = DeterministicBackend(_model(settings, slots=1))
    worker = Worker(settings, conn, backend)  # not started: only its hand-back is asked
    handed = await worker.orphans.hand_back_unstarted(consumer, first.reply)
    assert handed == 1
    again = await held.fetch(1, timeout=5)
    assert [m.metadata.sequence.stream for m in again] == [second.metadata.sequence.stream]
    assert again[0].metadata.num_delivered == 2
    for msg in (first, again[0]):
        await msg.ack()


# -- 4. a request whose deadline passed while it was queued (guard) ------------------------------


async def test_a_request_whose_deadline_passed_in_the_queue_is_never_generated_and_told_once(
    settings: MeshSettings, conn: Connection
) -> None:
    """GUARD (passes). One slot busy with a 1.5 s answer; a second request, queued directly
    (the nats CLI's way) with a deadline 0.5 s away, waits in the queue past it. When the slot
    frees, the worker skips it without generating and publishes exactly one
    deadline_exceeded (counted on the raw token subject); the message is let go."""
    backend = Counting(_model(settings, slots=1, token_delay_ms=50, faults=False))
    model = settings.worker.model.name
    scope = settings.nats.scope_or(DEFAULT_SCOPE)
    raw: list[object] = []

    async def got(msg: Msg) -> None:
        raw.append(decode_event(msg.data, msg.headers))

    sub = await conn.nc.subscribe(token_subject(scope, "late-1"), cb=got)
    await conn.nc.flush()
    async with Worker(settings, conn, backend) as worker:
        long = InferRequest(id="long-1", prompt="[tag:a] long", max_tokens=30, model=model)
        await publish_request(conn, settings.stream, long, scope=scope)
        await eventually(lambda: holds(backend.started == 1), 5, "the long answer under way")
        late = InferRequest(
            id="late-1",
            prompt="[tag:b] late",
            max_tokens=5,
            model=model,
            deadline=time.time() + 0.5,
        )
        await publish_request(conn, settings.stream, late, scope=scope)
        await eventually(lambda: holds(worker.stats.completed == 1), 8, "the long answer")
        await eventually(lambda: holds(bool(raw)), 5, "the late request's outcome")
        await eventually(lambda: queue_drained(conn, settings), what="both let go")
        await asyncio.sleep(0.5)  # anything more that would come
        assert backend.started == 1, "the late request was generated"
    await sub.unsubscribe()
    errors = [e for e in raw if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and errors[0].code == "deadline_exceeded", raw
    assert not [e for e in raw if isinstance(e, (TokenEvent, EndEvent))], raw


# -- 5. worker.fetch_batch is ignored ------------------------------------------------------------


async def test_a_pull_request_asks_for_no_more_than_fetch_batch(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before the fix (minor). ``worker.fetch_batch`` is documented as "Most requests pulled
    per fetch (never more than free slots)" and the architecture diagram says "fetch min(free
    slots, batch)"; nothing reads it: a worker of 8 slots with fetch_batch=2 asks JetStream
    for 8 in one pull request."""
    settings.worker.fetch_batch = 2
    model = settings.worker.model.name
    await provision(conn.jsm(), settings.stream, [model])
    batches: list[int] = []

    async def seen(msg: Msg) -> None:
        batches.append(int(json.loads(msg.data).get("batch", 1)))

    api = f"$JS.API.CONSUMER.MSG.NEXT.{settings.stream.name}.{consumer_name(model)}"
    sub = await conn.nc.subscribe(api, cb=seen)
    await conn.nc.flush()
    backend = DeterministicBackend(_model(settings, slots=8))
    async with Connection(settings.nats, "worker") as wconn, Worker(settings, wconn, backend):
        await eventually(lambda: holds(bool(batches)), 5, "a pull request")
    await sub.unsubscribe()
    assert max(batches) <= 2, f"pull requests asked for {batches} with fetch_batch=2"


# -- 6. a slow return path: the puller gives up requests still open at the server --------------


async def test_a_worker_behind_a_slow_link_never_holds_more_than_its_slots(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """Before the fix. The worker's link carries what the server sends 0.4 s late (a far
    region). A pull request (0.5 s expiry) is counted over by the puller at its expiry + 0.1 s
    (EXPIRY_MARGIN_S) from when it was *sent*; its 408, and a delivery the server made near its
    end, arrive 0.4 s later. In between the puller asks again for the same slot: the late
    delivery comes on the lingering subscription and is taken anyway, and the new request takes
    the next queued request. A 1-slot worker then holds two (an engine of one slot queues the
    second, ack-pending on a busy worker while others may idle)."""
    proxy = await TcpProxy(nats_server.port).start()
    wsettings = linked_settings(proxy.url)
    settings = make_settings(nats_server.url)
    model = settings.worker.model.name
    backend = Counting(_model(settings, slots=1, token_delay_ms=100, faults=False))
    try:
        async with Connection(settings.nats, "ops") as conn:
            await provision(conn.jsm(), settings.stream, [model])
            asks: list[float] = []

            async def asked(_msg: Msg) -> None:
                asks.append(time.monotonic())

            api = f"$JS.API.CONSUMER.MSG.NEXT.{settings.stream.name}.{consumer_name(model)}"
            sub = await conn.nc.subscribe(api, cb=asked)
            await conn.nc.flush()
            async with (
                Connection(wsettings.nats, "worker") as wconn,
                Worker(wsettings, wconn, backend) as worker,
            ):
                proxy.delay_down = 0.4
                sent = 0
                for trial in range(5):
                    # Idle: wait for a fresh pull request to reach the server, then queue two
                    # requests near its end (server time), as a trickle of traffic would.
                    count = len(asks)
                    await eventually(lambda n=count: holds(len(asks) > n), 5, "a pull request")
                    at = asks[-1]
                    await asyncio.sleep(max(0.0, at + 0.35 - time.monotonic()))
                    for k in range(2):
                        request = InferRequest(
                            id=f"slow-{trial}-{k}",
                            prompt=f"[tag:s{trial}{k}] x",
                            model=model,
                            max_tokens=6,
                        )
                        await publish_request(conn, settings.stream, request, scope=DEFAULT_SCOPE)
                        sent += 1
                    await eventually(
                        lambda sent=sent: holds(worker.stats.completed == sent), 10, "both answered"
                    )
                    if backend.most > 1:
                        break
                print(f"\nmost generations at once on a 1-slot worker: {backend.most}")
                assert backend.most <= 1, (
                    f"a 1-slot worker behind a slow link held {backend.most} deliveries at once"
                )
            await sub.unsubscribe()
    finally:
        await proxy.stop()


# -- 7. a burst past the fleet's capacity (guard) -----------------------------------------------


async def test_a_burst_past_the_fleets_slots_is_shared_and_answered_once_each(
    nats_server: NatsServer,
    conn: Connection,  # the fixture starts each test from an empty queue
) -> None:
    """GUARD (passes). Two workers of 2 slots, 12 requests at once, each answer 0.3 s: every
    request answered once and whole, no worker ever over its slots, both take a share."""
    settings = make_settings(nats_server.url)
    backends = [Counting(_model(settings, slots=2, token_delay_ms=50, faults=False)) for _ in "ab"]
    settings_b = settings.model_copy(deep=True)
    settings_b.worker.node_id = "worker-b"
    settings.worker.node_id = "worker-a"
    async with (
        Connection(settings.nats, "a") as ca,
        Connection(settings.nats, "b") as cb,
        Worker(settings, ca, backends[0]) as wa,
        Worker(settings_b, cb, backends[1]) as wb,
        MeshClient(settings=settings, first_event_timeout=20, idle_timeout=20) as client,
    ):
        answers = await asyncio.wait_for(
            asyncio.gather(
                *(
                    client.complete(
                        f"[tag:q{n}] x", via="cloud", max_tokens=6, deadline=time.time() + 20
                    )
                    for n in range(12)
                )
            ),
            20,
        )
        for n, answer in enumerate(answers):
            assert answer.text == "".join(f" q{n}{i}" for i in range(6))
        # A worker counts an answer once the store acked its end, which its reader may have
        # read a moment before.
        await eventually(lambda: holds(wa.stats.completed + wb.stats.completed == 12), 5)
        assert wa.stats.completed > 0 and wb.stats.completed > 0
        assert max(b.most for b in backends) <= 2
