"""The error that ends a request whose deliveries ran out outranks every attempt of it.

A worker that could not read the answer store numbers its attempt above any the store could
hold (:func:`cloud_node.takeover.unseen_attempt`). When that attempt's start reached the
client but not the store (the store lost meanwhile), and its worker then died on the last
delivery, the worker that hears JetStream give up on the request numbered its error from what
the store held: below the start the client had. The client dropped the error as stale and
waited, silent, for its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from cloud_node.publisher import AnswerPublisher
from cloud_node.takeover import unseen_attempt
from cloud_node.worker import Worker
from mesh.answer_store import AnswerStore, ensure_answer_stream
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import Completion, MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import provision
from protocol.codec import decode_event, reply_target, sniff
from protocol.errors import MaxDeliveriesError, MeshError
from protocol.messages import ErrorEvent
from protocol.stream import AnswerWriter
from protocol.subjects import (
    ANSWERS_STREAM,
    answer_subject,
    infer_subject,
    scope_of,
    token_subject,
)
from tests.conftest import make_settings
from tests.helpers import eventually


async def _held_exactly(conn: Connection, stream: str, n: int) -> bool:
    return (await conn.jsm().stream_info(stream)).state.messages == n


async def _held(conn: Connection, stream: str, n: int) -> bool:
    return (await conn.jsm().stream_info(stream)).state.messages >= n


@contextlib.asynccontextmanager
async def _asking(
    settings: MeshSettings,
) -> AsyncIterator[tuple[Connection, Connection, asyncio.Future[Completion]]]:
    """A worker's connection, an operator's, and a client's request via the cloud, queued."""
    stream = settings.stream
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "operator") as op,
        MeshClient(settings=settings, first_event_timeout=30, idle_timeout=30) as client,
    ):
        await provision(op.jsm(), stream, [settings.edge.cloud_model])
        await ensure_answer_stream(op.jsm(), stream)
        asking = asyncio.ensure_future(client.complete("x", via="cloud", max_tokens=4))
        await eventually(lambda: _held(op, stream.name, 1), what="the request queued")
        try:
            yield wconn, op, asking
        finally:
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)


async def test_the_max_deliveries_error_outranks_a_start_the_store_lost(
    own_server: NatsServer,
) -> None:
    settings = make_settings(own_server.url)
    stream = settings.stream
    async with _asking(settings) as (wconn, op, asking):
        queued = await op.jsm().get_msg(stream.name, 1)
        request_id, _ = reply_target(queued.data or b"", queued.headers)
        scope = scope_of(queued.subject or "")
        assert request_id is not None and scope is not None
        # The last delivery's worker could not read the store: its start reaches the client...
        store = AnswerStore(op, stream, filtered=False)
        fmt = sniff(queued.data or b"", queued.headers).reply_format
        started = AnswerPublisher(op, store, scope, request_id, fmt, timeout=5)
        await started.send(AnswerWriter(request_id, attempt=unseen_attempt(), node="w").start())
        await op.write_batch.flush()
        await eventually(lambda: _held(op, stream.answer_stream, 1), what="the start stored")
        await op.jsm().purge_stream(stream.answer_stream)  # ...and not the store; it dies
        worker = Worker(settings, wconn, DeterministicBackend(settings.worker.model))
        advisory = json.dumps({"stream_seq": 1, "deliveries": stream.max_deliver}).encode()
        await worker.outcomes.on_max_deliveries(Msg(wconn.nc, subject="advisory", data=advisory))
        with pytest.raises(MaxDeliveriesError):
            await asyncio.wait_for(asking, 10)


async def test_the_max_deliveries_error_goes_out_when_the_store_cannot_be_read(
    own_server: NatsServer,
) -> None:
    """JetStream gave up on the request (its last worker died) while the answer store could
    not be read (its stream without a leader, say): the worker that heard gave up too, and the
    client waited, silent, for its own timeout (30 s here); the request stayed queued."""
    settings = make_settings(own_server.url)
    stream = settings.stream
    async with _asking(settings) as (wconn, op, asking):
        worker = Worker(settings, wconn, DeterministicBackend(settings.worker.model))

        async def unreadable(*_args: object, **_kwargs: object) -> list[object]:
            raise MeshError("the answer store did not answer (scripted)", retryable=True)

        worker.outcomes.store.replay = unreadable  # type: ignore[method-assign]
        advisory = json.dumps({"stream_seq": 1, "deliveries": stream.max_deliver}).encode()
        await worker.outcomes.on_max_deliveries(Msg(wconn.nc, subject="advisory", data=advisory))
        with pytest.raises(MaxDeliveriesError):
            await asyncio.wait_for(asking, 10)
        assert await worker.outcomes.exhausted.wait(10)
        assert (await op.jsm().stream_info(stream.name)).state.messages == 0


async def test_the_outcome_of_a_request_that_can_wait_is_kept_however_long_the_hub_refuses(
    own_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JetStream gave up on a request that can wait (its last worker died). Its outcome is
    kept for its site before its queue message is deleted; the keep gave up after four tries
    (3.5 s: a hub restarting, an election), and the message was deleted all the same: the site
    never heard of the request again. Here the keep fails eight times, then the hub is back."""
    monkeypatch.setattr("cloud_node.outcomes.KEEP_RETRY_FIRST_S", 0.01, raising=False)
    monkeypatch.setattr("cloud_node.outcomes.KEEP_RETRY_MAX_S", 0.05, raising=False)
    settings = make_settings(own_server.url)
    stream = settings.stream
    scope, request_id = "site-x", "waits-1"
    async with (
        Connection(settings.nats, "worker") as wconn,
        Worker(settings, wconn, DeterministicBackend(settings.worker.model)) as worker,
    ):
        body = {"id": request_id, "prompt": "x", "max_tokens": 4, "deferrable": True}
        ack = await wconn.js.publish(  # a model no worker here takes: it stays queued
            infer_subject("elsewhere", scope), json.dumps(body).encode(), stream=stream.name
        )
        keep = worker.keeper.keep
        refused = 0

        async def refusing(*args: object, **kwargs: object) -> None:
            nonlocal refused
            if refused < 8:
                refused += 1
                raise MeshError("the hub is electing a leader (scripted)", retryable=True)
            await keep(*args, **kwargs)  # type: ignore[arg-type]

        worker.keeper.keep = refusing  # type: ignore[method-assign]
        advisory = json.dumps({"stream_seq": ack.seq, "deliveries": stream.max_deliver}).encode()
        await worker.outcomes.on_max_deliveries(Msg(wconn.nc, subject="advisory", data=advisory))
        assert await worker.outcomes.exhausted.wait(10)
        assert refused == 8
        kept = await wconn.jsm().get_msg(
            ANSWERS_STREAM, subject=answer_subject(scope, request_id), direct=True
        )
        outcome = decode_event(kept.data or b"")
        assert isinstance(outcome, ErrorEvent) and outcome.code == "max_deliveries", outcome
        assert (await wconn.jsm().stream_info(stream.name)).state.messages == 0


async def test_a_keep_that_waits_for_the_hub_holds_up_no_other_request_given_up_on(
    own_server: NatsServer,
) -> None:
    """The advisories' callbacks ran one at a time: while one request that can wait had its
    keep refused (the hub down), the next advisory, a plain request whose client listens, was
    not handled: its client waited silent for its timeout. Read from the stream, each advisory
    is ended on its own; one whose keep is refused is handed back and read again later."""
    settings = make_settings(own_server.url)
    stream = settings.stream
    scope = "site-x"
    async with (
        Connection(settings.nats, "worker") as wconn,
        Worker(settings, wconn, DeterministicBackend(settings.worker.model)) as worker,
        Connection(settings.nats, "client") as client,
    ):

        async def refusing(*_args: object, **_kwargs: object) -> None:
            raise MeshError("the hub is down (scripted)", retryable=True)

        worker.keeper.keep = refusing  # type: ignore[method-assign]
        queued = []
        for body in (
            {"id": "waits-1", "prompt": "x", "max_tokens": 4, "deferrable": True},
            {"id": "plain-2", "prompt": "x", "max_tokens": 4},
        ):
            queued.append(
                await client.js.publish(
                    infer_subject("elsewhere", scope), json.dumps(body).encode(), stream=stream.name
                )
            )
        told = asyncio.Event()

        async def hear(msg: Msg) -> None:
            if isinstance(decode_event(msg.data), ErrorEvent):
                told.set()

        await client.nc.subscribe(token_subject(scope, "plain-2"), cb=hear)
        await client.subscribed()
        subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream.name}.{worker.consumer}"
        for ack in queued:
            advisory = {"stream_seq": ack.seq, "deliveries": stream.max_deliver}
            await client.nc.publish(subject, json.dumps(advisory).encode())
        await asyncio.wait_for(told.wait(), 10)
        # The one whose keep is refused stays queued (its advisory handed back, read again
        # later): never dropped unkept; the plain one is ended and gone.
        await eventually(
            lambda: _held_exactly(wconn, stream.name, 1), what="the plain request's message gone"
        )
        assert worker.given_up._task is not None  # read from the stream (MESH_GIVEN_UP)
