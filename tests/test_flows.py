"""The mesh's main flows with real parts: nats-server, JetStream, the SmolLM2 GGUF."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.routing import create_router
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from protocol.codec import decode_event
from protocol.errors import CancelledByClientError, UnknownModelError
from protocol.messages import EndEvent, RestartEvent, TokenEvent
from protocol.subjects import token_subject
from tests.helpers import eventually, queue_drained, queue_state, stat_reaches

SIMPLE = "Say hello in five words."
COMPLEX = (
    "A train leaves at 3:15 pm and travels 240 km at 80 km/h. Explain step by step when it "
    "arrives, then compute 17 * 23 as a check."
)


async def test_local_path_streams_tokens_then_end(edge: EdgeNode, client: MeshClient) -> None:
    events = [e async for e in client.stream(SIMPLE, max_tokens=24, temperature=0)]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    end = events[-1]
    assert isinstance(end, EndEvent)
    assert tokens, "the local model produced no text"
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert [t.seq for t in tokens] == list(range(len(tokens)))
    assert end.seq == len(tokens)
    assert end.path == "local"
    assert end.served_by == f"edge:{edge.edge_id}"
    assert end.routing is not None and end.routing.decision == "local"
    assert end.routing.reason  # the decision is explained
    assert end.timings.ttft_ms is not None and end.timings.ttft_ms > 0
    assert 0 < end.usage.completion_tokens <= 24


async def test_escalated_path_relays_in_order_acks_and_empties_queue(
    worker: Worker, edge: EdgeNode, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    # Watch the token subjects as `nats sub 'mesh.v1.tok.>'` would: what the worker published.
    # The edge queues under an id of its own, so the client's id never names a queue subject.
    published: list[TokenEvent] = []
    queued_ids: set[str] = set()

    async def watch(msg: object) -> None:
        event = decode_event(msg.data)  # type: ignore[attr-defined]
        queued_ids.add(event.id)
        if isinstance(event, TokenEvent):
            published.append(event)

    watcher = await conn.nc.subscribe("mesh.v1.tok.>", cb=watch)
    events = [
        e
        async for e in client.stream(COMPLEX, max_tokens=32, temperature=0, request_id="escalated1")
    ]
    await watcher.unsubscribe()
    end = events[-1]
    assert isinstance(end, EndEvent)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert tokens
    assert [t.seq for t in tokens] == list(range(len(tokens)))
    assert end.path == "cloud"
    assert end.served_by == f"cloud:{worker.node_id}"
    assert end.routing is not None and end.routing.decision == "cloud"
    assert not end.routing.forced
    assert end.fallback is None
    assert end.timings.queue_ms is not None
    assert end.usage.completion_tokens == 32 and end.finish_reason == "length"
    # The edge relayed exactly what the worker generated, in order. A token may go out twice:
    # a reader that hears nothing for a while (the real model's prefill) asks the worker, which
    # publishes again what the reader lacks; the copy must be the same token.
    generated: dict[int, str] = {}
    for t in published:
        assert generated.setdefault(t.seq, t.text) == t.text, (t.seq, t.text)
    assert sorted(generated) == list(range(len(generated)))
    in_order = "".join(generated[seq] for seq in sorted(generated))
    assert generated and "".join(t.text for t in tokens) == in_order
    assert len(queued_ids) == 1 and "escalated1" not in queued_ids
    await stat_reaches(worker.stats, "completed", 1)
    await eventually(lambda: queue_drained(conn, settings), what="acked and empty queue")


async def test_route_override_forces_each_path(
    worker: Worker, edge: EdgeNode, client: MeshClient
) -> None:
    to_cloud = await client.complete(SIMPLE, route="cloud", max_tokens=8, temperature=0)
    to_local = await client.complete(COMPLEX, route="local", max_tokens=8, temperature=0)
    assert to_cloud.path == "cloud" and to_cloud.end.routing is not None
    assert to_cloud.end.routing.forced and to_cloud.end.routing.decision == "cloud"
    assert to_local.path == "local" and to_local.end.routing is not None
    assert to_local.end.routing.forced


async def test_falls_back_at_once_when_no_worker_is_alive(
    settings: MeshSettings, conn: Connection, edge_backend: object, client: MeshClient
) -> None:
    # A pool was deployed (its consumer exists) but no worker runs: the registry knows.
    from edge_node.router import HeuristicRouter
    from mesh.provision import provision

    await provision(conn.jsm(), settings.stream, ["smollm2"])
    async with EdgeNode(settings, conn, edge_backend, HeuristicRouter()):  # type: ignore[arg-type]
        began = time.monotonic()
        answer = await client.complete(COMPLEX, max_tokens=16, temperature=0)
        waited = time.monotonic() - began
    assert answer.path == "local"
    assert answer.end.routing is not None and answer.end.routing.decision == "cloud"
    assert answer.end.fallback == "no live worker serves 'smollm2'"
    assert waited < settings.edge.cloud_start_timeout  # no start timeout was spent
    assert (await queue_state(conn, settings))["messages"] == 0  # nothing was queued


async def test_falls_back_when_a_busy_pool_does_not_start_in_time(
    worker: Worker, edge: EdgeNode, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    # The only worker slot is taken by a long answer; the escalation cannot start in time.
    edge.settings.edge.cloud_start_timeout = 1.5
    long_answer = asyncio.create_task(
        client.complete("Write a long story about a cat.", via="cloud", max_tokens=300)
    )
    await stat_reaches(worker.stats, "fetched", 1)
    began = time.monotonic()
    answer = await client.complete(COMPLEX, max_tokens=16, temperature=0)
    waited = time.monotonic() - began
    assert answer.path == "local"
    assert answer.end.fallback is not None and "no worker started it" in answer.end.fallback
    assert waited >= 1.5
    await long_answer
    # The edge took its escalation back: the worker never runs it after the long answer.
    await eventually(lambda: queue_drained(conn, settings), what="empty queue")
    await asyncio.sleep(0.5)
    assert worker.stats.fetched == 1 and worker.stats.completed == 1


async def test_falls_back_at_once_when_no_pool_serves_the_cloud_model(
    edge: EdgeNode, client: MeshClient
) -> None:
    began = time.monotonic()
    answer = await client.complete(COMPLEX, max_tokens=8, temperature=0)
    assert answer.path == "local"
    assert answer.end.fallback is not None and "no worker pool" in answer.end.fallback
    assert time.monotonic() - began < 5  # no start timeout was spent
    assert edge.stats.get("fallback") == 1


async def test_sdk_complete_via_edge_and_via_cloud(
    worker: Worker, edge: EdgeNode, client: MeshClient
) -> None:
    via_edge = await client.complete(SIMPLE, max_tokens=12, temperature=0)
    via_cloud = await client.complete(SIMPLE, via="cloud", max_tokens=12, temperature=0)
    assert via_edge.text.strip() and via_cloud.text.strip()
    assert via_edge.path == "local"
    assert via_cloud.path == "cloud" and via_cloud.end.routing is None
    assert via_cloud.events[-1] is via_cloud.end


async def test_sdk_messages_and_unknown_model(
    worker: Worker, edge: EdgeNode, client: MeshClient
) -> None:
    answer = await client.complete(
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a color."},
        ],
        via="cloud",
        max_tokens=8,
        temperature=0,
    )
    assert answer.text.strip()
    with pytest.raises(UnknownModelError) as excinfo:
        await client.complete(SIMPLE, via="cloud", model="no-such-model")
    assert excinfo.value.code.value == "unknown_model"


async def test_cancel_stops_cloud_generation_and_acks(
    worker: Worker, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    received = 0
    async for event in client.stream(
        COMPLEX, via="cloud", max_tokens=2000, temperature=0.7, request_id="cancelme1"
    ):
        if isinstance(event, TokenEvent):
            received += 1
        if received >= 3:
            break  # leaving the stream cancels the request
    await stat_reaches(worker.stats, "cancelled", 1)
    await eventually(lambda: queue_drained(conn, settings), what="cancelled request acked")
    assert worker.stats.completed == 0


async def test_a_cancel_key_given_via_the_cloud_is_the_one_that_cancels(
    worker: Worker, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    # The caller's own key (another process of its may cancel with it), not one the SDK makes.
    from mesh.queue import cancel_payload
    from protocol.subjects import DEFAULT_SCOPE, cancel_subject

    async def read() -> None:
        received = 0
        async for event in client.stream(
            COMPLEX,
            via="cloud",
            max_tokens=2000,
            temperature=0.7,
            request_id="ownkey1",
            cancel_key="the-callers-own-key",
        ):
            if isinstance(event, TokenEvent):
                received += 1
                if received == 3:  # from elsewhere, as another process of the caller's would
                    subject = cancel_subject(settings.nats.scope_or(DEFAULT_SCOPE), "ownkey1")
                    await conn.nc.publish(subject, cancel_payload("the-callers-own-key"))

    with pytest.raises(CancelledByClientError):
        await read()
    await stat_reaches(worker.stats, "cancelled", 1)
    assert worker.stats.completed == 0


async def test_cancel_before_start_is_honoured(
    settings: MeshSettings, conn: Connection, worker_backend: object, client: MeshClient
) -> None:
    # Queue a request, cancel it, and only then start the worker: it must not generate.
    from mesh.provision import provision
    from mesh.queue import CloudCall, cancel_payload
    from protocol.messages import InferRequest

    await provision(conn.jsm(), settings.stream, ["smollm2"])
    key = "sender-secret-1"
    request = InferRequest(
        id="early-cancel", model="smollm2", prompt=SIMPLE, max_tokens=8, cancel_key=key
    )
    sub = await conn.nc.subscribe(token_subject("tests", request.id))
    async with Worker(settings, conn, worker_backend) as running:  # type: ignore[arg-type]
        # cancel first (the worker remembers it), then queue
        await conn.nc.publish(f"mesh.v1.cancel.tests.{request.id}", cancel_payload(key))
        await conn.nc.flush()
        async with CloudCall(conn, settings.stream, request, scope="tests"):
            msg = await sub.next_msg(timeout=10)
        await eventually(lambda: queue_drained(conn, settings), what="cancelled request dropped")
        assert running.stats.completed == 0
    from protocol.codec import to_exception

    error = to_exception(decode_event(msg.data))
    assert isinstance(error, CancelledByClientError)


async def test_concurrent_requests_all_complete_with_one_slot(
    worker: Worker, client: MeshClient, conn: Connection, settings: MeshSettings
) -> None:
    # Five requests at once against a one-slot worker: it pulls one at a time, none is lost.
    answers = await asyncio.gather(
        *(
            client.complete(f"Count to {n}.", via="cloud", max_tokens=6, temperature=0)
            for n in range(5)
        )
    )
    assert all(a.path == "cloud" and a.text for a in answers)
    assert len({a.end.id for a in answers}) == 5
    await stat_reaches(worker.stats, "completed", 5)
    await eventually(lambda: queue_drained(conn, settings), what="empty queue")


async def test_restart_event_resets_collected_text(client: MeshClient) -> None:
    # complete() drops text gathered before a restart (unit-level check of the SDK contract).
    from protocol.messages import Usage

    async def fake_stream(*_args: object, **_kwargs: object):
        yield TokenEvent(id="r", seq=0, text="partial ", attempt=1)
        yield RestartEvent(id="r", attempt=2)
        yield TokenEvent(id="r", seq=1, text="whole", attempt=2)
        yield EndEvent(id="r", seq=2, attempt=2, usage=Usage(completion_tokens=1))

    client.stream = fake_stream  # type: ignore[method-assign]
    answer = await client.complete("x")
    assert answer.text == "whole" and answer.restarts == 1


async def test_one_canonical_log_line_per_request(edge: EdgeNode, client: MeshClient) -> None:
    import structlog

    from mesh.config import LogSettings
    from mesh.logs import configure_logging, merge_bound

    configure_logging(LogSettings(level="info"))
    try:
        with structlog.testing.capture_logs([merge_bound]) as logs:
            answer = await client.complete(SIMPLE, max_tokens=6, temperature=0)

            async def logged() -> bool:  # the edge logs right after sending the end
                return any(entry["event"] == "request" for entry in logs)

            await eventually(logged, timeout=5, what="the canonical line")
            await asyncio.sleep(0.2)  # a second line, if any, would come at once
    finally:
        configure_logging(LogSettings(level="warning"))
    lines = [entry for entry in logs if entry["event"] == "request"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == answer.end.id and line["node_id"] == f"edge:{edge.edge_id}"
    assert line["outcome"] == "ok" and line["path"] == "local" and line["route"] == "local"
    assert line["tokens"] == answer.end.usage.completion_tokens and line["ttft_ms"] > 0


async def test_deadlines_at_the_edge(worker: Worker, edge: EdgeNode, client: MeshClient) -> None:
    from protocol.errors import DeadlineExceededError

    # Already past: never started, typed error.
    with pytest.raises(DeadlineExceededError):
        await client.complete(SIMPLE, deadline=time.time() - 1, max_tokens=4)
    # Too near for the cloud (cloud_min_budget, 2 s): routed locally at once, saying why (not
    # the router's choice, nor a fallback: the cloud was never asked). The deadline bounds the
    # local answer too: as much of it as the rule allows (1 s was tight for the real model on
    # a loaded machine: deadline_exceeded once in the parallel suite).
    near = await client.complete(COMPLEX, deadline=time.time() + 1.9, max_tokens=4, temperature=0)
    assert near.path == "local" and near.end.fallback is None
    assert near.end.routing is not None and "deadline too near" in near.end.routing.reason
    # Far enough: escalated as routed.
    far = await client.complete(COMPLEX, deadline=time.time() + 60, max_tokens=4, temperature=0)
    assert far.path == "cloud"


async def test_edge_stopping_mid_answer_tells_the_client_to_retry(
    settings: MeshSettings, conn: Connection, edge_backend: object, client: MeshClient
) -> None:
    from edge_node.router import HeuristicRouter
    from protocol.errors import UnavailableError

    edge = EdgeNode(settings, conn, edge_backend, HeuristicRouter())  # type: ignore[arg-type]
    await edge.start()
    received = 0

    async def consume() -> None:
        nonlocal received
        async for _event in client.stream("Count to one hundred.", route="local", max_tokens=400):
            received += 1
            if received == 2:
                await edge.stop(grace=0)  # no grace: the in-flight answer is cut

    try:
        with pytest.raises(UnavailableError) as excinfo:
            await consume()
    finally:
        await edge.stop(grace=0)
    assert received == 2, f"the error came after {received} events, not mid-answer"
    assert excinfo.value.retryable and "shutting down" in str(excinfo.value)


async def test_a_request_sent_while_the_edge_restarts_is_answered(
    settings: MeshSettings,
    conn: Connection,
    edge_backend: LlamaCppBackend,
    client: MeshClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nobody subscribed when it was sent (the edge daemon restarting): the SDK sends it again
    for a moment, and the edge that comes up answers it once."""
    import mesh.client
    from mesh.reader import AnswerReader

    # The product waits 2 s; a slow machine may take about that to start an edge.
    monkeypatch.setattr(mesh.client, "EDGE_RESTART_S", 20.0)
    unserved = 0
    original = AnswerReader._on_unserved

    def counting(reader: AnswerReader) -> None:
        nonlocal unserved
        unserved += 1
        original(reader)

    monkeypatch.setattr(AnswerReader, "_on_unserved", counting)
    edge = EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router))
    answer = asyncio.create_task(client.complete(SIMPLE, route="local", max_tokens=8))

    async def met_nobody() -> bool:
        return unserved >= 1

    await eventually(met_nobody, timeout=10, what="the request to meet no subscriber")
    assert not answer.done()
    async with edge:
        completion = await asyncio.wait_for(answer, 30)
    assert completion.text and completion.end.path == "local"
    assert edge.stats.get("rejoined") == 0  # one request reached the edge, not several


async def test_a_request_to_an_edge_nobody_serves_fails_typed_and_soon(
    settings: MeshSettings, client: MeshClient
) -> None:
    from mesh.client import EDGE_RESTART_S
    from protocol.errors import UnavailableError

    began = time.monotonic()
    with pytest.raises(UnavailableError, match="nobody is serving") as excinfo:
        await client.complete(SIMPLE, route="local", max_tokens=8)
    assert excinfo.value.retryable
    assert time.monotonic() - began < EDGE_RESTART_S + 2


async def test_sdk_timeout_cancels_the_edge_work(
    edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    from protocol.errors import MeshTimeoutError

    impatient = MeshClient(settings=settings, connection=conn, first_event_timeout=0.01)
    with pytest.raises(MeshTimeoutError):
        await impatient.complete(
            "Count to five hundred.", route="local", max_tokens=800, request_id="impatient1"
        )
    # The edge hears the cancel and frees its only local slot quickly.
    await eventually(lambda: _no_inflight(edge), timeout=5, what="edge to drop the request")
    assert edge.stats.get("cancelled") == 1


async def _no_inflight(edge: EdgeNode) -> bool:
    return edge.records.in_flight() == 0


async def test_an_edge_tries_its_cloud_pools_in_order_before_answering_locally(
    settings: MeshSettings, conn: Connection, worker: Worker, edge_backend: LlamaCppBackend
) -> None:
    # No pool serves "big"; the smaller pool (the worker's model) does.
    settings.edge.cloud_model = "big"
    settings.edge.cloud_fallbacks = [worker.backend.model]
    async with (
        EdgeNode(settings, conn, edge_backend, create_router(settings.edge.router)),
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        answer = await client.complete(COMPLEX, route="cloud", max_tokens=8, temperature=0)
        assert answer.path == "cloud" and answer.end.served_by == f"cloud:{worker.node_id}"
        assert answer.end.fallback is not None
        assert "'smollm2' pool after big: no worker pool serves 'big'" in answer.end.fallback
        # A client that names its model gets that model or a typed error: no chain.
        with pytest.raises(UnknownModelError):
            await client.complete(COMPLEX, route="cloud", model="big", max_tokens=8)


async def test_a_cancel_reaches_only_the_worker_holding_the_request(
    settings: MeshSettings, conn: Connection
) -> None:
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.config import ModelSettings

    model = ModelSettings(backend="deterministic", token_delay_ms=20, slots=2)
    seen: dict[str, list[str]] = {"broadcast": [], "addressed": []}

    async def record(msg: Msg) -> None:
        kind = "broadcast" if msg.subject.startswith("mesh.v1.cancel.") else "addressed"
        seen[kind].append(msg.subject)

    await conn.nc.subscribe("mesh.v1.cancel.>", cb=record)
    await conn.nc.subscribe("mesh.v1.worker.*.cancel.>", cb=record)
    settings.worker.node_id = "holder-a"
    async with Worker(settings, conn, DeterministicBackend(model)) as first:
        settings.worker.node_id = "holder-b"
        async with (
            Worker(settings, conn, DeterministicBackend(model)) as second,
            MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
        ):
            stream = client.stream("[tag:c] long", via="cloud", max_tokens=500)
            async for event in stream:
                if isinstance(event, TokenEvent) and event.seq >= 3:
                    break  # the client walks away mid-answer
            await stream.aclose()

            async def one_cancelled() -> bool:
                return first.stats.cancelled + second.stats.cancelled == 1

            await eventually(one_cancelled, timeout=10, what="the holder to cancel")
            holder = first if first.stats.cancelled else second
            await conn.nc.flush()
            assert seen["broadcast"] == []  # no other worker heard of it
            assert len(seen["addressed"]) == 1
            assert seen["addressed"][0].startswith(f"mesh.v1.worker.{holder.node_id}.cancel.")


async def test_a_cancel_for_a_dead_holder_reaches_whoever_takes_the_request_next(
    settings: MeshSettings, conn: Connection
) -> None:
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.config import ModelSettings

    settings.stream.ack_wait = 2.0  # the dead holder's request comes back quickly
    settings.nats.least_privilege = True  # so the client cannot delete it from the queue
    model = ModelSettings(backend="deterministic", token_delay_ms=20, slots=1)
    broadcast: list[str] = []

    async def record(msg: Msg) -> None:
        broadcast.append(msg.subject)

    await conn.nc.subscribe("mesh.v1.cancel.>", cb=record)
    settings.worker.node_id = "doomed"
    doomed_conn = await Connection(settings.nats, "doomed").connect()
    doomed = Worker(settings, doomed_conn, DeterministicBackend(model))
    await doomed.start()
    survivor_backend = DeterministicBackend(model)
    try:
        async with MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client:
            stream = client.stream("[tag:d] long", via="cloud", max_tokens=500)
            async for event in stream:
                if isinstance(event, TokenEvent) and event.seq >= 2:
                    break
            settings.worker.node_id = "survivor"
            async with Worker(settings, conn, survivor_backend) as survivor:
                # The holder dies (its connection goes, no goodbye); the client walks away.
                assert doomed._heartbeat._task is not None
                doomed._heartbeat._task.cancel()
                await doomed_conn.nc.close()
                await stream.aclose()

                async def broadcast_once() -> bool:
                    return len(broadcast) == 1

                # Nobody answered at the holder's address: the cancel went to every worker.
                await eventually(broadcast_once, timeout=5, what="the cancel broadcast")
                await stat_reaches(survivor.stats, "fetched", 1)  # the redelivery came to it
                await stat_reaches(survivor.stats, "rejected", 1)  # as cancelled, at once
                assert survivor.stats.completed == 0 and survivor_backend.started == 0
    finally:
        with contextlib.suppress(Exception):
            await doomed.stop()
