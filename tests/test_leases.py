"""A request that can wait, queued twice (its site's forward was retried after the queue's
dedupe window), is answered once: one generation, one answer in its token stream, and its kept
answer whole. Real nats-server, real workers, the deterministic test backend (every token
checkable). The last tests share these helpers: progress reports for an answer that outlasts
ack_wait, and an answer whose store went away while it ended."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from nats.aio.msg import Msg
from nats.js import api

from cloud_node.lease import Lease, Leases
from cloud_node.worker import Worker
from mesh import kept
from mesh.answer_store import ensure_answer_stream
from mesh.backends.base import Chunk
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.hub import provision_hub
from mesh.nats_server import NatsServer
from mesh.reader import AnswerReader
from protocol.codec import decode_event
from protocol.errors import MeshTimeoutError, UnavailableError
from protocol.fingerprint import request_fingerprint
from protocol.messages import Answer, EndEvent, ErrorEvent, InferRequest, StartEvent, TokenEvent
from protocol.stream import AnswerState
from protocol.subjects import (
    ANSWERS_STREAM,
    LEASE_WILDCARD,
    LEASES_STREAM,
    answer_subject,
    infer_subject,
    token_subject,
)
from tests.conftest import make_settings
from tests.helpers import eventually, queue_drained

MODEL = "leased"
SCOPE = "site-x"
TOKENS = 30


def _backend(token_delay_ms: int = 40) -> DeterministicBackend:
    # 30 tokens at 40 ms: 1.2 s of generation, long enough for a second copy to arrive.
    return DeterministicBackend(
        ModelSettings(backend="deterministic", name=MODEL, slots=2, token_delay_ms=token_delay_ms)
    )


async def _queue_copy(
    conn: Connection, settings: MeshSettings, rid: str, copy: str, tokens: int = TOKENS
) -> int:
    """One queued copy of the request (its queue sequence); a message id of its own, as a retry
    past the dedupe window gets (within the window JetStream itself drops the second)."""
    body = {"id": rid, "prompt": "[tag:q] go", "max_tokens": tokens, "deferrable": True}
    ack = await conn.js.publish(
        infer_subject(MODEL, SCOPE),
        json.dumps(body).encode(),
        stream=settings.stream.name,
        headers={"Nats-Msg-Id": f"{SCOPE}.{rid}.{copy}"},
    )
    return int(ack.seq)


async def _queue_live(conn: Connection, settings: MeshSettings, rid: str, prompt: str) -> None:
    """A request that cannot wait: its answer is only streamed, never kept."""
    body = {"id": rid, "prompt": prompt, "max_tokens": TOKENS}
    await conn.js.publish(
        infer_subject(MODEL, SCOPE), json.dumps(body).encode(), stream=settings.stream.name
    )


async def _acked_and_kept_whole(
    conn: Connection,
    settings: MeshSettings,
    rid: str,
    timeout: float,
    what: str,
    *,
    tokens: int = TOKENS,
) -> None:
    """Wait until every queued copy is acked; the kept answer is then the whole text."""
    await eventually(lambda: queue_drained(conn, settings, MODEL), timeout, what)
    answer = await _kept(conn, rid)
    assert answer is not None and answer.text == "".join(f" q{i}" for i in range(tokens))


async def _kept(conn: Connection, rid: str) -> Answer | None:
    try:
        msg = await conn.jsm().get_msg(
            ANSWERS_STREAM, subject=answer_subject(SCOPE, rid), direct=True
        )
    except Exception:  # not kept yet
        return None
    outcome = decode_event(msg.data or b"")
    return outcome if isinstance(outcome, Answer) else None


async def _started(worker: Worker) -> bool:
    return worker.stats.fetched > 0


async def _stored_events(worker: Worker, rid: str) -> list[object]:
    return list(await worker.store.replay(token_subject(SCOPE, rid)))


@contextlib.asynccontextmanager
async def _worker(
    settings: MeshSettings, conn: Connection, name: str, backend: DeterministicBackend
) -> AsyncIterator[Worker]:
    own = settings.model_copy(deep=True)
    own.worker.node_id = name
    async with Worker(own, conn, backend) as running:
        yield running


EXPECTED = "".join(f" q{i}" for i in range(TOKENS))


async def test_two_queued_copies_are_generated_once(
    settings: MeshSettings, conn: Connection
) -> None:
    rid = "twice-1"
    first, second = _backend(), _backend()
    async with (
        _worker(settings, conn, "lease-a", first) as a,
        _worker(settings, conn, "lease-b", second) as b,
    ):
        await _queue_copy(conn, settings, rid, "1")
        await _queue_copy(conn, settings, rid, "2")
        await _acked_and_kept_whole(conn, settings, rid, 20, "both copies acked")
        assert first.started + second.started == 1  # one generation, not two
        assert a.stats.other_copy + b.stats.other_copy == 1
        events = await _stored_events(a, rid)
    starts = [e for e in events if isinstance(e, StartEvent)]
    ends = [e for e in events if isinstance(e, EndEvent)]
    assert len(starts) == 1 and len(ends) == 1
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.seq for t in tokens] == list(range(len(tokens)))
    assert "".join(t.text for t in tokens) == EXPECTED


@contextlib.asynccontextmanager
async def _first_copy_dies_mid_answer(
    settings: MeshSettings, conn: Connection, rid: str, name: str
) -> AsyncIterator[None]:
    """Copy 1 of ``rid`` starts on worker ``name``, which dies after three tokens: its
    connection drops, so nothing is acked or nak'd and its lease is no longer refreshed."""
    seen = asyncio.Event()
    count = 0

    async def on_event(_msg: Msg) -> None:
        nonlocal count
        count += 1
        if count >= 4:  # the start and three tokens
            seen.set()

    sub = await conn.nc.subscribe(token_subject(SCOPE, rid), cb=on_event)
    doomed_conn = await Connection(settings.nats, name).connect()
    doomed_settings = settings.model_copy(deep=True)
    doomed_settings.worker.node_id = name
    doomed = Worker(doomed_settings, doomed_conn, _backend())
    await doomed.start()
    try:
        await _queue_copy(conn, settings, rid, "1")
        await asyncio.wait_for(seen.wait(), 10)
        await doomed_conn.nc.close()
        yield
    finally:
        await sub.unsubscribe()
        await doomed.stop()
        await doomed_conn.close()


async def test_a_dead_workers_copy_keeps_its_lease_and_is_continued(
    settings: MeshSettings, conn: Connection
) -> None:
    """Copy 1's worker dies mid-answer; copy 2 arrives while its lease stands and is let go;
    copy 1, redelivered, takes its own lease over and the answer is continued whole."""
    settings.stream.ack_wait = 2.0  # redelivered soon; the lease lasts 4 s without a refresh
    rid = "twice-2"
    async with _first_copy_dies_mid_answer(settings, conn, rid, "doomed"):
        await _queue_copy(conn, settings, rid, "2")
        survivor_backend = _backend()
        async with _worker(settings, conn, "survivor", survivor_backend) as survivor:
            await _acked_and_kept_whole(conn, settings, rid, 30, "copies acked")
            assert survivor.stats.other_copy == 1  # copy 2, while copy 1's lease stood
            assert survivor.stats.continued == 1  # copy 1, from where the dead worker stopped
            assert survivor_backend.started == 1
            events = await _stored_events(survivor, rid)
    starts = [e for e in events if isinstance(e, StartEvent)]
    assert [(s.attempt, s.node) for s in starts] == [(1, "cloud:doomed"), (2, "cloud:survivor")]


async def test_a_copy_arriving_after_the_lease_lapsed_numbers_after_the_first(
    settings: MeshSettings, conn: Connection
) -> None:
    """Copy 1's worker died and its lease has lapsed when copy 2 arrives: copy 2 takes the
    lease, sees copy 1's events in the store, and continues them as a later attempt (never a
    second attempt 1 in the same stream). Copy 1, redelivered, is then let go."""
    settings.stream.ack_wait = 2.0
    rid = "twice-3"
    async with _first_copy_dies_mid_answer(settings, conn, rid, "doomed-2"):
        await conn.jsm().purge_stream(LEASES_STREAM)  # the lease lapsed
        await _queue_copy(conn, settings, rid, "2")
        survivor_backend = _backend()
        async with _worker(settings, conn, "survivor-2", survivor_backend) as survivor:
            await _acked_and_kept_whole(conn, settings, rid, 30, "copies acked")
            assert survivor_backend.started == 1
            assert survivor.stats.other_copy + survivor.stats.already_done == 1
            events = await _stored_events(survivor, rid)
    attempts = [e.attempt for e in events if isinstance(e, StartEvent)]
    assert attempts == [1, 2], attempts  # copy 1's attempt, then copy 2's, in order


async def test_a_lease_store_that_does_not_answer_stalls_nothing(
    settings: MeshSettings, conn: Connection
) -> None:
    """The lease store is gone and something swallows lease writes without answering (as a
    server does with a write the credentials deny): requests that can wait are served as
    before, once, with progress reports in time (no redelivery), and the next one at once."""
    settings.stream.ack_wait = 2.0  # a lease call that waited out publish_timeout (5 s) would
    # miss a progress report and have the request redelivered
    backend = _backend()
    async with _worker(settings, conn, "lease-less", backend) as worker:
        await conn.jsm().delete_stream(LEASES_STREAM)
        swallow = await conn.nc.subscribe("mesh.v1.lease.>")  # never replies
        try:
            for rid in ("no-store-1", "no-store-2"):
                await _queue_copy(conn, settings, rid, "1")
                await _acked_and_kept_whole(conn, settings, rid, 20, "acked")
        finally:
            await swallow.unsubscribe()
        assert backend.started == 2 and worker.stats.fetched == 2  # never redelivered
        assert worker.stats.completed == 2


async def test_a_lease_whose_copy_left_the_queue_unanswered_is_taken_over(
    settings: MeshSettings, conn: Connection
) -> None:
    """The lease names a copy that is no longer queued and kept nothing (it was rejected, say):
    the next copy takes the lease over and is answered, never let go in silence."""
    rid = "orphan-1"
    backend = _backend()
    async with _worker(settings, conn, "lease-heir", backend) as worker:
        fingerprint = request_fingerprint(
            InferRequest.model_validate(
                {"id": rid, "prompt": "[tag:q] go", "max_tokens": TOKENS, "deferrable": True}
            )
        )
        written = await worker.leases.take(SCOPE, rid, 999_999, fingerprint)
        assert isinstance(written, Lease)  # a lease for a copy that was never queued
        await _queue_copy(conn, settings, rid, "1")
        await _acked_and_kept_whole(conn, settings, rid, 20, "the copy acked")
        assert backend.started == 1 and worker.stats.other_copy == 0


async def test_a_request_that_can_wait_cancelled_mid_answer_keeps_its_cancel(
    settings: MeshSettings, conn: Connection
) -> None:
    """Cancelled while it generates: asked for again by id, its site finds the typed
    ``cancelled``, not nothing."""
    rid = "cancel-1"
    started = asyncio.Event()

    async def on_event(_msg: Msg) -> None:
        started.set()

    sub = await conn.nc.subscribe(token_subject(SCOPE, rid), cb=on_event)
    backend = _backend()
    try:
        async with _worker(settings, conn, "lease-cancel", backend) as worker:
            await _queue_copy(conn, settings, rid, "1")
            await asyncio.wait_for(started.wait(), 10)
            await conn.nc.publish(f"mesh.v1.cancel.{SCOPE}.{rid}", b"")
            await eventually(lambda: queue_drained(conn, settings, MODEL), 20, "the copy acked")
            assert worker.stats.cancelled == 1
    finally:
        await sub.unsubscribe()
    msg = await conn.jsm().get_msg(ANSWERS_STREAM, subject=answer_subject(SCOPE, rid), direct=True)
    outcome = decode_event(msg.data or b"")
    assert isinstance(outcome, ErrorEvent) and outcome.code == "cancelled", outcome


async def test_a_worker_that_lost_its_lease_hands_its_copy_back(
    settings: MeshSettings, conn: Connection
) -> None:
    """While copy 1 generates, its lease lapses and copy 2 (queued behind it: one slot) takes
    it, as happens when the worker could not reach the store for longer than a lease. At its
    next progress report the worker finds the lease gone, stops copy 1 and hands it back.
    Copy 2 then continues copy 1's answer as attempt 2, and copy 1, redelivered, is let go."""
    settings.stream.ack_wait = 2.0  # progress reports every 0.4 s, lease refreshes every 1 s
    rid = "lost-1"
    started = asyncio.Event()

    async def on_event(_msg: Msg) -> None:
        started.set()

    sub = await conn.nc.subscribe(token_subject(SCOPE, rid), cb=on_event)
    backend = DeterministicBackend(  # 3 s of generation: lease refreshes come every 1 s
        ModelSettings(backend="deterministic", name=MODEL, slots=1, token_delay_ms=100)
    )
    try:
        async with _worker(settings, conn, "lease-loser", backend) as worker:
            await _queue_copy(conn, settings, rid, "1")
            await asyncio.wait_for(started.wait(), 10)
            second = await _queue_copy(conn, settings, rid, "2")  # waits: no free slot
            await conn.jsm().purge_stream(LEASES_STREAM)  # copy 1's lease lapsed
            fingerprint = request_fingerprint(
                InferRequest.model_validate(
                    {"id": rid, "prompt": "[tag:q] go", "max_tokens": TOKENS, "deferrable": True}
                )
            )
            assert isinstance(await worker.leases.take(SCOPE, rid, second, fingerprint), Lease)
            await _acked_and_kept_whole(conn, settings, rid, 30, "copies acked")
            assert worker.stats.requeued == 1  # copy 1, handed back
            assert worker.stats.other_copy == 1  # copy 1 again, let go while copy 2 ran
            assert worker.stats.completed == 1
            events = await _stored_events(worker, rid)
    finally:
        await sub.unsubscribe()
    attempts = [e.attempt for e in events if isinstance(e, StartEvent)]
    assert attempts == [1, 2], attempts
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert (
        "".join(t.text for t in tokens if t.attempt == 2)
        == EXPECTED[len("".join(t.text for t in tokens if t.attempt == 1)) :]
    )


async def test_an_answer_longer_than_ack_wait_is_delivered_once(
    settings: MeshSettings, conn: Connection
) -> None:
    """Progress reports start one interval into a generation (an answer done sooner costs no
    task for them), and from then keep an answer that outlasts ack_wait several times from
    being redelivered, its lease refreshed all along."""
    settings.stream.ack_wait = 1.0  # reports every 0.2 s; the answer takes 1.2 s
    backend = _backend()
    async with _worker(settings, conn, "patient", backend) as worker:
        await _queue_copy(conn, settings, "long-1", "1")
        await _acked_and_kept_whole(conn, settings, "long-1", 20, "acked")
        assert backend.started == 1 and worker.stats.fetched == 1  # never redelivered
        assert worker.stats.completed == 1


async def test_an_answer_that_ended_while_the_store_was_away_is_stored_whole_later(
    settings: MeshSettings, conn: Connection
) -> None:
    """The answer store goes away mid-answer (its stream deleted) and comes back only after the
    worker acked the request, unconfirmed. The worker keeps publishing what the store lacks
    until it holds the whole answer: a reader with a gap finds it there."""
    backend = _backend()
    async with _worker(settings, conn, "settler", backend) as worker:
        await _queue_live(conn, settings, "away-1", "[tag:q] go")
        await eventually(lambda: _has_started(worker, "away-1"), 10, "the answer started")
        await conn.jsm().delete_stream(settings.stream.answer_stream)
        await eventually(lambda: _completed(worker), 20, "the request acked")
        await ensure_answer_stream(conn.jsm(), settings.stream)

        async def whole() -> bool:
            events = await _stored_events(worker, "away-1")
            tokens = {e.seq: e.text for e in events if isinstance(e, TokenEvent)}
            ended = any(isinstance(e, EndEvent) for e in events)
            return ended and "".join(tokens[i] for i in sorted(tokens)) == EXPECTED

        await eventually(whole, 20, "the store holds the whole answer")


async def _has_started(worker: Worker, rid: str) -> bool:
    return any(isinstance(e, TokenEvent) for e in await _stored_events(worker, rid))


async def _completed(worker: Worker) -> bool:
    return worker.stats.completed == 1


async def test_a_final_error_that_ended_while_the_store_was_away_is_stored_later(
    settings: MeshSettings, conn: Connection
) -> None:
    """Likewise for an answer that ends in a final error (the engine fails on the last
    delivery): once the store is back it holds the attempt and its typed error."""
    settings.stream.max_deliver = 1  # the first failure is the last
    backend = _backend()
    async with _worker(settings, conn, "settler-err", backend) as worker:
        await _queue_live(conn, settings, "away-2", "[tag:q] [fail-after:20] go")
        await eventually(lambda: _has_started(worker, "away-2"), 10, "the answer started")
        await conn.jsm().delete_stream(settings.stream.answer_stream)
        await eventually(lambda: queue_drained(conn, settings, MODEL), 20, "the request let go")
        await ensure_answer_stream(conn.jsm(), settings.stream)

        async def stored_error() -> bool:
            events = await _stored_events(worker, "away-2")
            tokens = {e.seq for e in events if isinstance(e, TokenEvent)}
            errors = [e for e in events if isinstance(e, ErrorEvent)]
            return tokens == set(range(len(tokens))) and len(tokens) > 0 and len(errors) == 1

        await eventually(stored_error, 20, "the store holds the attempt and its error")
        errors = [e for e in await _stored_events(worker, "away-2") if isinstance(e, ErrorEvent)]
        assert errors[0].code == "max_deliveries"


async def test_a_request_that_can_wait_is_kept_whole_while_the_token_store_is_away(
    settings: MeshSettings, conn: Connection
) -> None:
    """The token store goes away mid-answer, but the kept answers' stream is there: the worker
    keeps the answer its own attempt sent (it began the answer), not a max_deliveries error.
    And a worker stopping with that answer still settling does not wait for it."""
    settings.stream.max_deliver = 1  # no second delivery to fall back on
    settings.worker.drain_grace = 30.0
    backend = _backend()
    worker = Worker(settings.model_copy(deep=True), conn, backend)
    await worker.start()
    try:
        await _queue_copy(conn, settings, "away-3", "1")
        await eventually(lambda: _has_started(worker, "away-3"), 10, "the answer started")
        await conn.jsm().delete_stream(settings.stream.answer_stream)
        await _acked_and_kept_whole(conn, settings, "away-3", 20, "acked")
        assert worker.stats.completed == 1
    finally:
        await asyncio.wait_for(worker.stop(), 10)  # not the 30 s grace: settling is cancelled


async def test_a_worker_without_its_lease_stream_still_answers_requests_that_can_wait() -> None:
    """Credentials minted before the lease stream existed, or its subjects taken: the worker
    logs it, serves without leases, and a request that can wait is still answered and kept
    whole. ``mesh provision``, which must leave the hub complete, says why instead."""
    async with NatsServer(port=-1) as server:
        settings = make_settings(server.url)
        async with Connection(settings.nats, "lease-squat") as conn:
            squat = api.StreamConfig(name="SQUAT", subjects=[LEASE_WILDCARD])
            await conn.jsm().add_stream(squat)
            with pytest.raises(UnavailableError, match=LEASES_STREAM):
                await provision_hub(conn.jsm(), settings.stream, [MODEL])
            backend = _backend()
            async with _worker(settings, conn, "lease-less", backend) as worker:
                assert not worker.leases.enabled
                await _queue_copy(conn, settings, "no-lease-1", "1")
                await _acked_and_kept_whole(conn, settings, "no-lease-1", 20, "acked")
            assert backend.started == 1


class _Marked(DeterministicBackend):
    """The deterministic backend with every token marked by its worker: two workers' answers
    to one prompt differ, so a reader that mixed them would show it."""

    def __init__(self, mark: str, token_delay_ms: int) -> None:
        super().__init__(
            ModelSettings(
                backend="deterministic", name=MODEL, slots=1, token_delay_ms=token_delay_ms
            )
        )
        self.mark = mark

    async def generate(  # type: ignore[override]
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncIterator[Chunk]:
        async with contextlib.aclosing(super().generate(request)) as chunks:
            async for chunk in chunks:
                yield replace(chunk, text=chunk.text.replace(" q", f" {self.mark}"))


async def test_a_second_copy_that_cannot_read_the_store_never_mixes_with_the_first() -> None:
    """Two queued copies of a request that can wait, no leases (their stream cannot be had),
    and the answer store gone while the first copy's answer streams: the second copy cannot
    see that the first began. It numbers its attempt above anything the store could hold, so a
    reader takes it as the newest and starts over with it, rather than taking two attempts
    numbered alike for one and mixing their tokens. The reader ends with one worker's whole
    answer."""
    async with NatsServer(port=-1) as server:
        # The first copy's end waits for a store that is gone: 1 s, not 5, before it says so.
        settings = make_settings(server.url, worker__publish_timeout=1.0)
        async with Connection(settings.nats, "mix") as conn:
            await conn.jsm().add_stream(api.StreamConfig(name="SQUAT", subjects=[LEASE_WILDCARD]))
            rid = "mix-1"
            reader = AnswerReader(conn, AnswerState(rid), None, what="the cloud")
            await reader.subscribe(token_subject(SCOPE, rid))
            slow, fast = _Marked("a", 60), _Marked("b", 5)
            got: list[object] = []
            async with _worker(settings, conn, "mix-a", slow):
                await _queue_copy(conn, settings, rid, "1")
                while reader.state.positions < 5:  # the first copy's answer is under way
                    got.extend(await reader.next(10))
                async with _worker(settings, conn, "mix-b", fast) as b:
                    await conn.jsm().delete_stream(settings.stream.answer_stream)
                    await _queue_copy(conn, settings, rid, "2")
                    while not reader.state.done:
                        out = await reader.next(10)
                        assert out, f"no outcome: {reader.state.missing()}"
                        got.extend(out)
                    assert fast.started == 1 and b.stats.fetched == 1
            await reader.close()
    outcome = reader.state.outcome
    assert isinstance(outcome, EndEvent), outcome
    assert reader.state.text() in ("".join(f" {m}{i}" for i in range(TOKENS)) for m in "ab")


async def test_a_whole_answer_stored_before_its_worker_died_is_kept_not_max_deliveries() -> None:
    """The last delivery's worker stored the whole answer, then died before keeping it and
    acking: the consumer gives up on the request (max_deliver 1), and the worker that handles
    that advisory keeps the stored answer, not a max_deliveries error."""
    async with NatsServer(port=-1) as server:
        settings = make_settings(server.url, stream__ack_wait=1.0, stream__max_deliver=1)
        async with Connection(settings.nats, "survivor") as conn:
            dying_conn = await Connection(settings.nats, "dying").connect()
            try:
                async with _worker(settings, dying_conn, "dies", _backend()) as dying:

                    async def dies_before_keeping(*_args: object) -> bool:
                        await dying_conn.nc.close()  # the end is stored; keep and ack never come
                        return False

                    dying.handler._keep = dies_before_keeping  # type: ignore[method-assign]
                    await _queue_copy(conn, settings, "died-1", "1")
                    await eventually(
                        lambda: _started(dying), 10, "the request taken by the dying worker"
                    )
                    async with _worker(settings, conn, "stays", _backend()):
                        await _acked_and_kept_whole(conn, settings, "died-1", 20, "advisory")
            finally:
                await dying_conn.close()


async def test_a_lease_stream_that_could_not_be_had_at_start_is_asked_for_until_it_is(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # JetStream does not answer in time for the lease stream when the worker starts (an election,
    # several workers provisioning at once): it starts without leases, and must not stay so.
    ensure = kept.ensure
    refused: list[str] = []

    async def slow_for_leases(jsm: object, config: api.StreamConfig) -> None:
        if config.name == LEASES_STREAM and not refused:
            refused.append(str(config.name))
            raise MeshTimeoutError("JetStream did not answer while provisioning the leases")
        await ensure(jsm, config)  # type: ignore[arg-type]

    monkeypatch.setattr(kept, "ensure", slow_for_leases)
    rid = "leases-back-1"
    first, second = _backend(), _backend()
    async with (
        _worker(settings, conn, "lease-c", first) as c,
        _worker(settings, conn, "lease-d", second) as d,
    ):
        assert refused, "the lease stream was never refused"

        async def leased() -> bool:
            return bool(c.status()["leases"] and d.status()["leases"])

        await eventually(leased, what="both workers have leases again")
        await _queue_copy(conn, settings, rid, "1")
        await _queue_copy(conn, settings, rid, "2")
        await _acked_and_kept_whole(conn, settings, rid, 20, "both copies acked")
        assert first.started + second.started == 1  # one generation, not two


async def test_a_lease_write_that_fails_once_does_not_let_the_lease_lapse(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One refresh of a lease is not written (the store did not answer in time, once). The worker
    # keeps new claims away from the store for a lease's lifetime; its held leases must still
    # be refreshed at the next reports, or they lapse, and a second copy of the request arriving
    # then is generated too.
    settings.stream.ack_wait = 1.0  # leases last 2 s; refreshed every 0.5 s with the reports
    writes: list[str] = []
    write = Leases._write

    async def fails_once(leases: Leases, subject: str, copy: int, fp: str, expect: int) -> object:
        writes.append(subject)
        if len(writes) == 2:  # the first refresh after the claim
            leases._trouble("lease not written", TimeoutError())
            return None
        return await write(leases, subject, copy, fp, expect)

    monkeypatch.setattr(Leases, "_write", fails_once)
    rid = "refresh-1"
    # 40 tokens at 100 ms: 4 s of generation, twice a lease's lifetime at ack_wait 1 s.
    first, second = _backend(token_delay_ms=100), _backend(token_delay_ms=100)
    async with (
        _worker(settings, conn, "lease-e", first),
        _worker(settings, conn, "lease-f", second),
    ):
        await _queue_copy(conn, settings, rid, "1", tokens=40)

        async def refresh_failed() -> bool:
            return len(writes) >= 2

        await eventually(refresh_failed, what="a refresh not written")
        await asyncio.sleep(kept.lease_ttl(settings.stream) + 0.3)  # past the unrefreshed lease
        await _queue_copy(conn, settings, rid, "2", tokens=40)
        await _acked_and_kept_whole(conn, settings, rid, 20, "both copies acked", tokens=40)
        assert first.started + second.started == 1  # one generation, not two
