"""The SDK's answer path at its edges: a caller slower than the tokens past its deadline, a
tail dropped from a full buffer while a store read is in flight, a deadline whose worker stands
still (the withdraw not awaited), a request larger than one NATS message. Each test failed on
the code before its fix (a review of mesh/reader.py and mesh/client.py).

Real nats-server; answers are published on a plain connection as an edge or a worker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.reader import AnswerReader
from protocol.codec import WireFormat, decode_request, dump_event
from protocol.errors import DeadlineExceededError, MeshError
from protocol.messages import EndEvent, TokenEvent, Usage, WireEvent
from protocol.stream import AnswerState, AnswerWriter
from protocol.subjects import edge_infer_subject

MSGPACK = WireFormat.MSGPACK


# -- a fake edge: answers each request on its reply inbox, as a script says ------------------
@contextlib.asynccontextmanager
async def fake_edge(server: NatsServer, edge_id: str, answer: object) -> AsyncIterator[Client]:
    """Subscribe to ``edge_id``'s infer subject; for each request run ``answer(nc, req, reply)``
    in a task of its own."""
    nc = await nats.connect(server.url)
    tasks: set[asyncio.Task[None]] = set()

    async def on_request(msg: Msg) -> None:
        req, _fmt = decode_request(msg.data, msg.headers)
        task = asyncio.create_task(answer(nc, req, msg.reply))  # type: ignore[operator]
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await nc.subscribe(edge_infer_subject(edge_id), cb=on_request)
    await nc.flush()
    try:
        yield nc
    finally:
        for task in list(tasks):
            task.cancel()
        await nc.close()


async def publish(nc: Client, subject: str, event: WireEvent) -> None:
    await nc.publish(subject, dump_event(event, MSGPACK))
    await nc.flush()


# -- 1. the deadline is not enforced while events keep coming ----------------------------------
async def test_deadline_bounds_a_stream_whose_tokens_keep_coming(
    nats_server: NatsServer, settings: MeshSettings
) -> None:
    """A generator that goes on past the request's deadline (a worker whose clock lags, an edge
    that does not cut it short), read by a caller a little slower per token (a slow socket):
    past the deadline, ``deadline_exceeded``. Before, ``_read`` checked the deadline only when
    ``next()`` came back empty, and the caller, always finding a token buffered, read on to
    the end (1.88 s after a 0.5 s deadline)."""

    async def slow_answer(nc: Client, req: object, reply: str) -> None:
        writer = AnswerWriter(req.id, node="edge:fake")  # type: ignore[attr-defined]
        await publish(nc, reply, writer.start())
        for i in range(60):  # 1.2 s of tokens
            await publish(nc, reply, writer.token(f"t{i} "))
            await asyncio.sleep(0.02)
        await publish(nc, reply, writer.end(finish_reason="stop", usage=Usage()))

    async with (
        fake_edge(nats_server, settings.edge.edge_id, slow_answer),
        MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
    ):
        began = time.time()
        deadline = began + 0.5
        outcome: object
        seen: list[object] = []
        try:
            async for event in client.stream("hi", deadline=deadline):
                seen.append(event)
                outcome = event
                await asyncio.sleep(0.03)  # the caller passes each token on (a slow socket)
        except MeshError as err:
            outcome = err
        took = time.time() - began
    assert any(isinstance(e, TokenEvent) for e in seen), "no tokens: the test proves nothing"
    assert isinstance(outcome, DeadlineExceededError), (
        f"deadline 0.5 s: got {type(outcome).__name__} after {took:.2f} s"
    )
    assert took < 1.0, f"deadline_exceeded came {took:.2f} s after the start (deadline 0.5 s)"


# -- 2. a buffer drop while a repair is in flight is forgotten ------------------------------
class _HeldRepair:
    """A repair that waits until released, then returns what the "store" held when it was
    asked (a store read is a snapshot); later calls return everything at once."""

    def __init__(self) -> None:
        self.kept: list[WireEvent] = []
        self.release = asyncio.Event()
        self.calls = 0
        self.began = asyncio.Event()

    async def __call__(self, _state: AnswerState) -> list[WireEvent]:
        self.calls += 1
        snapshot = list(self.kept)
        if self.calls == 1:
            self.began.set()
            await self.release.wait()
        return snapshot


async def test_a_tail_dropped_by_a_full_buffer_during_a_repair_is_fetched_at_once(
    nats_server: NatsServer, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's own buffer is full (its caller is slow): it drops messages, and a repair
    fetches them at once, even when one was in flight as they dropped (its store read may
    predate them). Before, the drop set a due repair only when none was set, and the repair in
    flight cleared it at its end: a lost tail waited for the quiet spell (1 s to 8 s)."""
    monkeypatch.setattr("mesh.reader._QUIET_FIRST_S", 30.0)  # only the drop's repair can heal
    subject = "mesh.v1.tok.review.drop1"
    repair = _HeldRepair()
    reader = AnswerReader(conn, AnswerState("drop1"), repair, what="the cloud", pending_limit=3)
    writer = AnswerWriter("drop1", node="cloud:w1")
    events: list[WireEvent] = [writer.start(), writer.token("a"), writer.token("b")]
    tail: list[WireEvent] = [writer.token(f"c{i}") for i in range(6)]
    tail.append(writer.end(finish_reason="stop", usage=Usage()))
    await reader.subscribe(subject)
    await conn.nc.flush()
    worker = await nats.connect(nats_server.url)
    got: list[WireEvent] = []
    try:
        for event in events:
            repair.kept.append(event)
            await publish(worker, subject, event)
        for _ in range(10):
            if len(got) < 3:
                got += await reader.next(0.5)
        assert len(got) == 3 and repair.calls == 0, got
        reader.repair_now()  # a check (a reconnect, a quiet spell): the store read begins
        assert await reader.next(0.1) == []
        await asyncio.wait_for(repair.began.wait(), 2)
        # The caller is busy elsewhere: the tail comes, the buffer takes 3, drops the rest.
        for event in tail:
            repair.kept.append(event)
            await publish(worker, subject, event)
        await asyncio.sleep(0.2)
        assert reader.dropped > 0, "nothing dropped: the test proves nothing"
        repair.release.set()  # the store read ends (it was asked before the tail came)
        began = time.monotonic()
        while not reader.state.done and time.monotonic() - began < 4:
            got += await reader.next(0.5)
        healed = time.monotonic() - began
    finally:
        await worker.close()
        await reader.close()
    assert reader.state.done and isinstance(reader.state.outcome, EndEvent), (
        f"answer not complete after {healed:.1f} s: {reader.state.positions} positions, "
        f"{reader.dropped} dropped, {repair.calls} repair(s), missing {reader.state.missing()}"
    )
    assert healed < 1.0, f"the dropped tail came {healed:.2f} s later"
    texts = [e.text for e in got if isinstance(e, TokenEvent)]
    assert texts == ["a", "b"] + [f"c{i}" for i in range(6)]


# -- 3. the typed deadline error waits for the withdraw's round trips -------------------------
async def test_deadline_exceeded_via_the_cloud_is_not_held_back_by_the_withdraw(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection
) -> None:
    """The worker answering stands still for the client (its link swallows what it writes, as
    a dying link or a hung process does): ``deadline_exceeded`` comes at the deadline. Before,
    ``_via_cloud`` first awaited ``call.withdraw()``, whose cancel waits for an answer from
    that very worker (``ADDRESSED_CANCEL_WAIT_S``, 0.5 s): 503 ms late."""
    from cloud_node.worker import Worker
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.config import ModelSettings
    from mesh.testing.proxy import TcpProxy
    from tests.conftest import linked_settings

    proxy = await TcpProxy(nats_server.port).start()
    worker_settings = linked_settings(proxy.url)
    model = ModelSettings(
        backend="deterministic", name=settings.worker.model.name, token_delay_ms=20
    )
    try:
        async with (
            Connection(worker_settings.nats, "review-worker") as worker_conn,
            Worker(worker_settings, worker_conn, DeterministicBackend(model)),
            MeshClient(settings=settings, first_event_timeout=10, idle_timeout=10) as client,
        ):
            deadline = time.time() + 1.5
            tokens = 0
            outcome: object = None
            try:
                async for event in client.stream(
                    "[tag:w] a long story", via="cloud", max_tokens=400, deadline=deadline
                ):
                    if isinstance(event, TokenEvent):
                        tokens += 1
                        if tokens == 3:
                            proxy.swallow()  # the worker's writes go nowhere from now on
                    outcome = event
            except MeshError as err:
                outcome = err
            late = time.time() - deadline
            assert tokens >= 3, f"only {tokens} tokens: the test proves nothing"
            assert proxy.swallowed, "nothing was swallowed: the test proves nothing"
    finally:
        await proxy.stop()
    assert isinstance(outcome, DeadlineExceededError), outcome
    # tests/test_deadlines.py allows LATE_S = 0.5 s on a loaded 2-core machine.
    print(f"\nlate: {late * 1000:.0f} ms")
    assert late < 0.3, f"deadline_exceeded reached the caller {late * 1000:.0f} ms after it"


# -- 4. a request over the server's max payload: not a typed error ---------------------------
@pytest.mark.parametrize("via", ["cloud", "edge"])
async def test_a_request_over_the_max_payload_ends_in_one_typed_error(
    nats_server: NatsServer, settings: MeshSettings, conn: Connection, via: str
) -> None:
    """A prompt that validates (no length limit on ``prompt``) but whose request is larger than
    the server's max_payload (1 MiB by default): ``payload_too_large``, not retryable. Before,
    via the cloud the caller got nats-py's ``MaxPayloadError``; via an edge, ``unavailable``,
    which says to retry a request that can never be sent."""
    from cloud_node.worker import Worker
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.config import ModelSettings
    from protocol.errors import ErrorCode

    model = ModelSettings(backend="deterministic", name=settings.worker.model.name)
    big = "x" * (conn.nc.max_payload + 1024)

    async def never(nc: Client, req: object, reply: str) -> None:
        return None

    async with (
        Worker(settings, conn, DeterministicBackend(model)),
        fake_edge(nats_server, settings.edge.edge_id, never),
        MeshClient(settings=settings, first_event_timeout=5, idle_timeout=5) as client,
    ):
        raised: BaseException | None = None
        try:
            await asyncio.wait_for(client.complete(big, via=via, max_tokens=2), 20)
        except BaseException as exc:  # what the caller gets, whatever it is
            raised = exc
    assert isinstance(raised, MeshError), f"not a typed error: {raised!r}"
    assert raised.code is ErrorCode.PAYLOAD_TOO_LARGE and not raised.retryable, (
        f"{raised.code.value} (retryable={raised.retryable}): {raised.message}"
    )
