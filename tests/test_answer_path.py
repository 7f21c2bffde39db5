"""Failover rules of the answer path, one at a time, with workers in this process on the
deterministic backend (every answer known exactly) and a real nats-server."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from nats.aio.msg import Msg
from nats.js.manager import JetStreamManager

from cloud_node.worker import Worker
from mesh.answer_store import AnswerStore
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.provision import provision
from mesh.queue import CloudCall
from mesh.reader import AnswerReader
from protocol.codec import decode_event
from protocol.errors import MaxDeliveriesError, MeshTimeoutError, UnavailableError
from protocol.messages import EndEvent, InferRequest, StartEvent, TokenEvent, WireEvent
from tests.helpers import eventually, queue_drained, stat_reaches

PROMPT = "[tag:ap] count"


def backend(token_ms: float = 10) -> DeterministicBackend:
    return DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=token_ms)
    )


@pytest.fixture
async def fast(settings: MeshSettings, conn: Connection) -> MeshSettings:
    """Settings with a short ack_wait, so a dead worker's request moves on in a second."""
    settings.stream.ack_wait = 1.0
    await provision(conn.jsm(), settings.stream, ["smollm2"])
    return settings


async def stop_all(workers: list[tuple[Worker, Connection]]) -> None:
    """Stop every worker a test started (in a finally: none may outlive its test)."""
    for worker, wconn in workers:
        await worker.stop()
        await wconn.close()


async def worker_on_own_connection(settings: MeshSettings, name: str) -> tuple[Worker, Connection]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = name
    wconn = await Connection(own.nats, name).connect()
    worker = Worker(own, wconn, backend())
    await worker.start()
    return worker, wconn


async def test_a_lost_ack_after_the_end_never_causes_a_second_generation(
    fast: MeshSettings, conn: Connection, client: MeshClient
) -> None:
    workers = [await worker_on_own_connection(fast, "first")]
    first, first_conn = workers[0]

    async def ack_lost(*_args: object, **_kwargs: object) -> None:
        await first_conn.nc.close()  # the end is stored; the ack never reaches the server

    first.handler.ack = ack_lost
    try:
        answer = await client.complete(PROMPT, via="cloud", max_tokens=12)
        assert answer.text == Script(tag="ap").answer(12)
        workers.append(await worker_on_own_connection(fast, "second"))
        second = workers[1][0]
        # After ack_wait the request is redelivered: the second worker finds its outcome stored
        # and acks it without generating.
        await stat_reaches(second.stats, "already_done", 1)
        assert second.backend.started == 0  # type: ignore[attr-defined]
        await eventually(lambda: queue_drained(conn, fast), what="redelivery acked")
    finally:
        await stop_all(workers)


async def test_a_started_request_is_continued_after_its_start_by(
    fast: MeshSettings, conn: Connection
) -> None:
    workers = [await worker_on_own_connection(fast, "doomed")]
    doomed_conn = workers[0][1]
    request = InferRequest(
        prompt=PROMPT, model="smollm2", max_tokens=60, stream=True, start_by=time.time() + 0.5
    )
    events: list[object] = []
    try:
        async with CloudCall(conn, fast.stream, request, scope="tests") as call:
            while not call.reader.state.done:
                for event in await call.reader.next(10):
                    events.append(event)
                    if isinstance(event, TokenEvent) and event.seq == 3 and len(workers) == 1:
                        await doomed_conn.nc.close()
                        workers.append(await worker_on_own_connection(fast, "survivor"))
        starts = [e for e in events if isinstance(e, StartEvent)]
        assert [s.attempt for s in starts] == [1, 2]
        assert starts[1].seq > 0  # continued, not refused and not started over
        end = events[-1]
        assert isinstance(end, EndEvent) and end.attempt == 2
        assert call.reader.state.text() == Script(tag="ap").answer(60)
        assert time.time() > request.start_by  # type: ignore[operator]
    finally:
        await stop_all(workers)


async def test_a_started_request_past_its_start_by_starts_over_when_the_store_cannot_be_read(
    fast: MeshSettings, conn: Connection
) -> None:
    # The worker that takes over cannot read what the first attempt left (the store is away for
    # a moment). "Cannot read" is not "nothing started": the answer, begun before its start_by,
    # starts over rather than ending in deadline_exceeded with its deadline far off.
    workers = [await worker_on_own_connection(fast, "doomed")]
    doomed_conn = workers[0][1]
    request = InferRequest(
        prompt=PROMPT, model="smollm2", max_tokens=120, stream=True, start_by=time.time() + 0.4
    )
    events: list[object] = []
    second_start = 0.0

    async def survivor_cannot_read_the_store() -> None:
        worker, _wconn = await worker_on_own_connection(fast, "survivor")
        workers.append((worker, _wconn))

        async def away(*_args: object) -> None:
            raise UnavailableError("the answer store is away")

        worker.takeover.read = away  # type: ignore[method-assign]

    try:
        async with CloudCall(conn, fast.stream, request, scope="tests") as call:
            while not call.reader.state.done:
                for event in await call.reader.next(10):
                    events.append(event)
                    if isinstance(event, StartEvent) and event.attempt > 1:
                        second_start = time.time()
                    late = time.time() > request.start_by  # type: ignore[operator]
                    if isinstance(event, TokenEvent) and late and len(workers) == 1:
                        await doomed_conn.nc.close()  # dies mid-answer, past its start_by
                        await survivor_cannot_read_the_store()
        starts = [e for e in events if isinstance(e, StartEvent)]
        # The store unread: numbered above any attempt it could not see (a loaded machine may
        # add one more).
        assert starts[0].attempt == 1 and starts[1].attempt > 1, starts
        assert starts[1].seq == 0  # it could not know what to continue: it started over
        end = events[-1]
        assert isinstance(end, EndEvent) and end.attempt >= 2, end
        assert call.reader.state.text() == Script(tag="ap").answer(120)
        assert second_start > request.start_by  # type: ignore[operator]  # taken over past it
    finally:
        await stop_all(workers)


class SlowOnce:
    """An answer store whose first read waits as long as the reader lets it, then fails (its
    server does not answer); everything else as the store it stands in front of."""

    def __init__(self, store: AnswerStore, default_wait: float) -> None:
        self._store = store
        self._default_wait = default_wait
        self.waited: list[float] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def replay(self, subject: str, timeout: float | None = None) -> list[WireEvent]:
        if self.waited:
            return await self._store.replay(subject, timeout=timeout)
        self.waited.append(self._default_wait if timeout is None else timeout)
        await asyncio.sleep(self.waited[0])
        raise MeshTimeoutError("the answer store did not answer")


async def test_a_slow_store_does_not_hold_a_taken_over_delivery_past_its_ack_wait(
    fast: MeshSettings, conn: Connection
) -> None:
    # The worker taking over reads what the first attempt left; the store is slow to answer.
    # It holds the delivery meanwhile, with no progress report yet: a read that waited the
    # connection's request timeout (5 s, past ack_wait's 1 s here) let JetStream hand the
    # request out again meanwhile. A read gives up at a fifth of ack_wait, and the answer
    # starts over at once.
    workers = [await worker_on_own_connection(fast, "doomed")]
    doomed_conn = workers[0][1]
    request = InferRequest(prompt=PROMPT, model="smollm2", max_tokens=60, stream=True)
    events: list[object] = []
    store: SlowOnce | None = None
    survivor: Worker | None = None
    try:
        async with CloudCall(conn, fast.stream, request, scope="tests") as call:
            while not call.reader.state.done:
                for event in await call.reader.next(10):
                    events.append(event)
                    if isinstance(event, TokenEvent) and event.seq == 3 and survivor is None:
                        await doomed_conn.nc.close()
                        survivor, wconn = await worker_on_own_connection(fast, "survivor")
                        workers.append((survivor, wconn))
                        store = SlowOnce(survivor.takeover.store, fast.nats.request_timeout)
                        survivor.takeover.store = store  # type: ignore[assignment]
        assert survivor is not None and store is not None
        assert store.waited == [0.2], store.waited  # it gave up at a fifth of ack_wait
        end = events[-1]
        # One takeover, numbered above any attempt it could not see in the store.
        assert isinstance(end, EndEvent) and end.attempt > 1, end
        assert len([e for e in events if isinstance(e, StartEvent)]) == 2, events
        assert call.reader.state.text() == Script(tag="ap").answer(60)
        assert survivor.stats.fetched == 1, survivor.stats
    finally:
        await stop_all(workers)


@pytest.mark.chaos
async def test_exhausted_deliveries_reach_the_client_as_a_typed_error(
    fast: MeshSettings, conn: Connection, client: MeshClient
) -> None:
    fast.stream.max_deliver = 2
    await provision(conn.jsm(), fast.stream, ["smollm2"])
    dead: list[tuple[Worker, Connection]] = []
    watcher: Worker | None = None

    async def kill_each_attempt() -> None:
        nonlocal watcher
        for name in ("one", "two"):
            worker, wconn = await worker_on_own_connection(fast, name)
            dead.append((worker, wconn))
            await stat_reaches(worker.stats, "fetched", 1)
            await asyncio.sleep(0.1)  # a few tokens out, then the worker dies
            await wconn.nc.close()
        # A healthy worker of the pool hears JetStream give up on the request.
        watcher, _ = await worker_on_own_connection(fast, "watcher")

    killer = asyncio.ensure_future(kill_each_attempt())
    try:
        with pytest.raises(MaxDeliveriesError) as excinfo:
            await client.complete(PROMPT, via="cloud", max_tokens=400)
        await killer
        assert "2 deliveries" in excinfo.value.message
        assert watcher is not None
        await stat_reaches(watcher.stats, "max_deliveries", 1)  # counted once it is stored
        await eventually(lambda: queue_drained(conn, fast), what="exhausted request removed")
    finally:  # a worker left running would serve the next tests' requests
        killer.cancel()
        await stop_all([*dead, *([(watcher, watcher.conn)] if watcher is not None else [])])


async def test_an_event_neither_the_store_nor_the_reader_got_is_sent_again_by_its_worker(
    fast: MeshSettings, client: MeshClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-node hub's answer-store leader killed as a token went out: the store's followers never
    got it, nor did the reader, whose server was the one killed. The worker's own link never
    dropped, so it sees nothing to publish again until its end goes unconfirmed, an election
    later. The reader, its gap unfilled by the store, asks the worker; the answer stands still
    for a moment, not for seconds."""
    lost = 5

    def is_lost(event: object) -> bool:
        return isinstance(event, TokenEvent) and event.seq == lost and event.attempt == 1

    real_on_msg, real_replay = AnswerReader._on_msg, AnswerStore.replay
    dropped: list[int] = []

    def on_msg(self: AnswerReader, msg: Msg) -> None:
        if not dropped and msg.data and is_lost(decode_event(msg.data, msg.headers)):
            dropped.append(lost)  # its server died with it
            return
        real_on_msg(self, msg)

    async def replay(
        self: AnswerStore, subject: str, timeout: float | None = None, silence: float | None = None
    ) -> list[WireEvent]:
        events = await real_replay(self, subject, timeout, silence)
        if self.conn is client.conn:  # what the surviving replicas hold
            events = [e for e in events if not is_lost(e)]
        return events

    monkeypatch.setattr(AnswerReader, "_on_msg", on_msg)
    monkeypatch.setattr(AnswerStore, "replay", replay)
    workers = [await worker_on_own_connection(fast, "w")]
    try:
        text, times = [], []
        async for event in client.stream(PROMPT, via="cloud", max_tokens=40):
            if isinstance(event, TokenEvent):
                text.append(event.text)
                times.append(time.monotonic())
        assert dropped, "the token was never dropped: the test proves nothing"
        assert "".join(text) == Script(tag="ap").answer(40)
        assert max(b - a for a, b in itertools.pairwise(times)) < 1.0
    finally:
        await stop_all(workers)


async def test_withdrawing_a_queued_request_does_not_wait_on_a_queue_that_does_not_answer(
    fast: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edge withdraws a request before answering it locally. The queue's delete is only a
    courtesy (the cancel covers it); a stream without a leader (an election) answers no API
    call until its timeout, and the local answer must not wait for that."""
    await provision(conn.jsm(), fast.stream, models=[fast.worker.model.name])
    asked = asyncio.Event()

    async def no_answer(*_args: object, **_kw: object) -> bool:
        asked.set()
        await asyncio.sleep(60)  # as a JetStream call to a leaderless stream, up to its timeout
        return True

    monkeypatch.setattr(JetStreamManager, "delete_msg", no_answer)
    request = InferRequest(prompt=PROMPT, max_tokens=5, model=fast.worker.model.name)
    async with CloudCall(conn, fast.stream, request, scope="tests") as call:  # nobody serves it
        began = time.monotonic()
        await call.withdraw()
        took = time.monotonic() - began
    assert asked.is_set(), "the queue was never asked to delete it: the test proves nothing"
    assert took < 2.0, f"withdrawing took {took:.1f} s"
