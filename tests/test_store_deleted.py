"""The answer store (``MESH_TOK``) deleted under a running worker at awkward moments: an answer
that starts while it is being put back, and a deletion heard while the worker's restore is
already running. Each answer must still end whole in the store (a reader repairing a gap, a
request that can wait, a lost ack all read it there), and the store must come back without
waiting for an answer to notice."""

from __future__ import annotations

import asyncio
import time

import pytest

from cloud_node import worker as worker_module
from mesh.answer_store import AnswerStore
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import expected_text
from tests.helpers import eventually, holds
from tests.test_lost_state import _stream_exists, _worker_and_client, stored_whole


async def test_an_answer_that_starts_while_the_store_is_put_back_is_stored_whole(
    own_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's restore takes 0.5 s (a slow JetStream): an answer started meanwhile sends
    its start and first tokens to no store, and its end to the store put back. It is caught up
    at its end. Before, its end's ack made it look whole: the store kept 10 of 20 tokens and
    no start, and nothing filled them."""
    async with _worker_and_client(own_server, slots=1, token_delay_ms=50) as (
        settings,
        worker,
        op,
        client,
    ):
        assert (await client.complete("[tag:a] x", via="cloud", max_tokens=4)).text
        provision = worker._provision

        async def slow_provision() -> None:
            await asyncio.sleep(0.5)
            await provision()

        monkeypatch.setattr(worker, "_provision", slow_provision)
        await op.jsm().delete_stream(settings.stream.answer_stream)
        answer = await client.complete("[tag:z] x", via="cloud", max_tokens=20, request_id="z1")
        assert answer.text == expected_text("z", 20)
        await eventually(
            lambda: stored_whole(worker, "z1", expected_text("z", 20)),
            timeout=10,
            what="the answer whole in the store",
        )


async def test_a_store_deleted_while_the_restore_runs_is_put_back_too(
    own_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore under way (for the queue's consumer, deleted) has put the store in place when
    the store is deleted: the advisory's restore is not started again while one runs, so it
    runs once more after it. Before, the store stayed deleted while the worker said ``ok``,
    until an answer's end noticed (a second later) or, on an idle worker, never."""
    async with _worker_and_client(own_server, slots=1) as (settings, worker, op, client):
        name = settings.stream.answer_stream
        assert (await client.complete("[tag:a] x", via="cloud", max_tokens=4)).text
        provision, deleted = worker_module.provision_hub, asyncio.Event()

        async def deleting_after(*args: object, **kwargs: object) -> object:
            hub = await provision(*args, **kwargs)  # type: ignore[arg-type]
            if not deleted.is_set():
                await op.jsm().delete_stream(name)
                deleted.set()
                # Its advisory comes while this restore still runs.
                await eventually(lambda: holds(worker.store.missing), what="the deletion heard")
            return hub

        monkeypatch.setattr(worker_module, "provision_hub", deleting_after)
        await op.jsm().delete_consumer(settings.stream.name, worker.consumer)
        await asyncio.wait_for(deleted.wait(), 10)
        began = time.monotonic()
        await eventually(lambda: _stream_exists(op, name), timeout=10, what="the store back")
        back = time.monotonic() - began
        await eventually(
            lambda: holds(not worker.conn.recovery.pending), what="the worker's restore done"
        )
        assert not worker.store.missing
        began = time.monotonic()
        answer = await client.complete("[tag:r] x", via="cloud", max_tokens=4, request_id="r1")
        assert answer.text == expected_text("r", 4)
        took = time.monotonic() - began
        print(f"\nstore deleted during a restore: back in {back:.2f} s; next answer {took:.2f} s")
        assert back < 1.0 and took < 0.5, (back, took)


async def test_a_worker_that_stops_lets_the_store_go(
    conn: Connection, settings: MeshSettings
) -> None:
    """Once nobody puts the store back (the worker stops), it is not "missing" any more: ends
    wait for its acks again, and an answer under way while it was gone is caught up at its
    end (its generation moves). Before, a stop during the restore left it missing for good."""
    told: list[str] = []
    store = AnswerStore(conn, settings.stream, filtered=False)
    store.on_missing = told.append
    store.deleted("stream MESH_TOK was deleted")
    assert store.missing and store.losses == 1 and told
    store.let_go()
    assert not store.missing and store.losses == 2
    store.deleted("again")  # nobody to put it back: nothing claims it is being put back
    assert not store.missing and store.losses == 3 and len(told) == 1
