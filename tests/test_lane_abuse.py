"""What a client or an edge may do within its own lane under `mesh creds`, and what it may no
longer do to others through the nodes that serve it: have its edge answer into the mesh's own
subjects, crowd out another edge's store reads, make a worker publish an answer again and
again; and the typed refusal a worker started under another worker's credentials hears. Each
"Before the fix" test failed on the code before it (review S20a).

Each test runs the operator-mode hub that `mesh creds` mints (``tests/test_security.py``'s
fixtures): every process under its own minted identity, nothing mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.answer_store import AnswerStore
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.connection import Connection
from protocol.errors import MeshError, OverloadedError, UnauthorizedError
from protocol.subjects import token_subject
from tests.test_security import (  # noqa: F401 - fixtures
    EDGES,
    Denials,
    Hub,
    _ask,
    hub,
    mesh,
)


async def test_a_client_cannot_have_its_edge_write_into_the_mesh_through_cancel_resend_or_answer(
    mesh: Hub,  # noqa: F811
) -> None:
    # Before the fix (minor, lanes): docs/security.md says the edge refuses `mesh.` and `$`
    # reply subjects for the client's sake (its response permission would carry any), and
    # `take()` does so for `infer`. The `cancel`, `resend` and `answer` endpoints answer
    # whatever reply subject the client names: a client whose credentials allow only
    # `mesh.v1.edge.<E>.*` has its edge queue junk into MESH_INFER, publish cancels and
    # orphan words, and call the JetStream API in the edge's lane.
    model = mesh.settings("worker-w1").worker.model.name
    targets = (
        f"mesh.v1.infer.{model}.site-a",  # the queue: a worker fetches and rejects each
        "mesh.v1.cancel.site-a.x1",
        "mesh.v1.orphan.site-a.x1",
        "$JS.API.CONSUMER.RESET.MESH_ANSWERS.site_site-a",
    )
    seen: list[str] = []
    async with Connection(mesh.settings("operator").nats, "op") as op:

        async def record(msg: Msg) -> None:
            seen.append(msg.subject)

        for subject in targets:
            await op.nc.subscribe(subject, cb=record)
        await op.nc.flush()
        client = await Denials().connect(mesh, "client-site-a")
        try:
            assert client.nc is not None
            # The client itself may not publish there: the server refuses it.
            await client.nc.publish(targets[0], b"{}")
            await client.refused("Publish", targets[0])
            ask = json.dumps({"id": "x1", "inbox": "_INBOX.client.site-a-apps.x"}).encode()
            for endpoint in ("cancel", "resend", "answer"):
                for reply in targets:
                    await client.nc.publish(f"mesh.v1.edge.site-a.{endpoint}", ask, reply=reply)
            await client.nc.flush()
            # The edge answers within milliseconds: by the time its answer to a proper ask
            # comes back, any publish it made for the asks above has been made.
            answer = await client.nc.request("mesh.v1.edge.site-a.cancel", ask, timeout=5)
            assert json.loads(answer.data) == {"cancelled": False}
            await op.nc.flush()
            await asyncio.sleep(0.2)  # a bounded look, as tests/test_server_publishes.py does
        finally:
            await client.close()
    assert seen == [], f"the edge published for its client into {sorted(set(seen))}"


async def test_one_edges_flood_of_its_own_store_reads_does_not_refuse_another_edges_repair(
    mesh: Hub,  # noqa: F811
) -> None:
    # Before the fix (heal/minor, cross-lane): the workers' store service answers at most
    # MAX_AT_ONCE (64) reads at a time per worker, for all scopes together. Edge A may publish
    # store reads in its own lane only, but as many as it likes: while it does, edge B's repair
    # (its own lane, sent once) is refused `overloaded`. Cancels got a per-scope bound for the
    # same reason (CancelBook); the store service's bound is shared.
    spy = await Denials().connect(mesh, "edge-site-a")
    settings_b = mesh.settings("edge-site-b")
    try:
        assert spy.nc is not None
        async with Connection(settings_b.nats, "edge-b") as conn_b:
            store_b = AnswerStore(conn_b, settings_b.stream)
            assert store_b.filtered  # least privilege: B reads through the workers
            assert await store_b.replay(token_subject("site-b", "b1"), timeout=3) == []
            inbox = spy.nc.new_inbox()
            await spy.nc.subscribe(inbox + ".>")
            refused = 0
            for _round in range(10):
                for n in range(2000):
                    await spy.nc.publish(
                        f"mesh.v1.store.site-a.f{n}",
                        b'{"max_bytes": 1048576}',
                        reply=f"{inbox}.{n}",
                    )
                await spy.nc.flush()
                try:
                    await store_b.replay(token_subject("site-b", "b1"), timeout=3)
                except OverloadedError:
                    refused += 1
            assert refused == 0, f"B's own store read was refused busy {refused} of 10 times"
    finally:
        await spy.close()


@pytest.fixture
async def paced(hub: Hub) -> AsyncIterator[Hub]:  # noqa: F811
    """As test_security's ``mesh``: one worker (tokens 20 ms apart) and two edges."""
    worker_settings = hub.settings("worker-w1", MESH_WORKER_MODEL_TOKEN_DELAY_MS="20")
    async with contextlib.AsyncExitStack() as stack:
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "w1"))
        backend = DeterministicBackend(worker_settings.worker.model)
        await stack.enter_async_context(Worker(worker_settings, wconn, backend))
        for edge in EDGES:
            settings = hub.settings(f"edge-{edge}")
            econn = await stack.enter_async_context(Connection(settings.nats, "edge"))
            local = DeterministicBackend(settings.edge.model)
            await stack.enter_async_context(EdgeNode(settings, econn, local, HeuristicRouter()))
        yield hub


async def test_one_edges_alive_words_cannot_have_a_worker_publish_its_answer_again_and_again(
    paced: Hub,
) -> None:
    # Before the fix (minor, availability): every "are you there?" word that says what its
    # reader has (`{"attempt": 0, "seq": 0}`: nothing) makes the worker publish the whole
    # answer again (cloud_node/orphans.py `_on_alive` -> Handler.resend), with no bound per
    # answer or per sender. Edge A may send such words in its own lane only
    # (mesh.v1.worker.*.alive.A.*), but as many as it likes: each ~30-byte word costs the
    # worker's loop and the hub the whole answer so far (x50 here, x thousands for a long
    # answer), awaited in the one subscription that answers every scope's readers' words;
    # edge B's word to that worker waits behind them (the reader's wait is 0.2 s, after which
    # it reports the worker as standing still).
    spy = await Denials().connect(paced, "edge-site-a")
    settings_b = paced.settings("edge-site-b")
    try:
        assert spy.nc is not None
        started: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        received = 0

        async def on_token(msg: Msg) -> None:
            nonlocal received
            received += 1
            if not started.done():
                started.set_result(msg.subject.rpartition(".")[2])

        await spy.nc.subscribe("mesh.v1.tok.site-a.*", cb=on_token)
        victim = asyncio.ensure_future(_ask(paced, "site-a", "[tag:a] long", 200))
        request_id = await asyncio.wait_for(started, 10)
        await asyncio.sleep(1.0)  # some 50 tokens out
        word = json.dumps({"attempt": 0, "seq": 0}).encode()
        words = 500
        for _ in range(words):
            subject = f"mesh.v1.worker.w1.alive.site-a.{request_id}"
            await spy.nc.publish(subject, word, reply=spy.nc.new_inbox())
        await spy.nc.flush()
        async with Connection(settings_b.nats, "edge-b") as conn_b:
            began = time.monotonic()
            await conn_b.nc.request("mesh.v1.worker.w1.alive.site-b.b1", b"", timeout=5)
            waited = time.monotonic() - began
        assert await victim == "".join(f" a{i}" for i in range(200))  # A's own answer: exact
        # The answer is 202 events (start, 200 tokens, end); A's words may have it sent again
        # once or twice, not once per word.
        assert received <= 3 * 202, (
            f"{words} words of A's had the worker publish {received - 202} events again "
            f"(B's word to it waited {waited:.3f}s)"
        )
    finally:
        await spy.close()


async def test_a_client_that_may_only_call_its_edge_hears_at_once_that_it_may_not_queue(
    mesh: Hub,  # noqa: F811
) -> None:
    # Before the fix (typed, minor): the SDK under a client's minted credentials (which may
    # only call its edge) asked via="cloud" got the right typed error, `unauthorized`, but
    # only after the JetStream look (1 s) and its publish's ack wait (request_timeout: 5 s by
    # default) had run out, though the server refused the look and the publish within one
    # round trip each (mesh/refusals.py heard both, and nothing waiting listened).
    settings = mesh.settings("client-site-a", MESH_NATS_REQUEST_TIMEOUT="5")
    async with MeshClient(settings=settings) as client:
        began = time.monotonic()
        with pytest.raises(UnauthorizedError):
            await client.complete("[tag:q] x", via="cloud", max_tokens=5)
        took = time.monotonic() - began
    assert took < 1.0, f"the refusal was said after {took:.1f}s"


async def test_a_sender_queueing_outside_its_credentials_scope_hears_at_once_that_it_may_not(
    mesh: Hub,  # noqa: F811
) -> None:
    # The same for a publish refused on its own: edge site-a's credentials may look up the
    # model's pool (the look answers) but queue only as `site-a`. A sender under them set to
    # queue as `site-b` (a copied .env) heard `unauthorized` only when its JetStream ack wait
    # (request_timeout) ran out; now as soon as the server refuses the publish, each time.
    settings = mesh.settings("edge-site-a", MESH_NATS_SCOPE="site-b", MESH_NATS_REQUEST_TIMEOUT="5")
    async with MeshClient(settings=settings) as client:
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises(UnauthorizedError) as excinfo:
                await client.complete("[tag:s] x", via="cloud", max_tokens=5)
            took = time.monotonic() - began
            assert "mesh.v1.infer." in str(excinfo.value) and ".site-b" in str(excinfo.value)
            assert took < 1.0, f"the refusal was said after {took:.1f}s"
        assert not [s for s in client.conn.refusals.publishes if s.startswith("$js.api")]


async def test_a_worker_started_under_another_workers_credentials_is_told_unauthorized(
    hub: Hub,  # noqa: F811
) -> None:
    # Before the fix (typed, minor): worker credentials name one node id (its registry key,
    # its status/alive/cancel/reserve subjects). A worker started as another id under them
    # (MESH_WORKER_NODE_ID=w9 with worker-w1's .creds: a copied .env, a renamed host) has its
    # subscriptions and its registry key refused by the server at once, yet it fails its start
    # after ~8 s with `timeout: cannot announce this node: TimeoutError()`, not with the
    # `unauthorized` and reason docs/security.md promises for wrong credentials.
    settings = hub.settings("worker-w1", MESH_WORKER_NODE_ID="w9")
    began = time.monotonic()
    async with Connection(settings.nats, "w9") as conn:
        worker = Worker(settings, conn, DeterministicBackend(settings.worker.model))
        with pytest.raises(MeshError) as excinfo:
            await asyncio.wait_for(_start_and_stop(worker), 20)
    took = time.monotonic() - began
    assert isinstance(excinfo.value, UnauthorizedError), repr(excinfo.value)
    assert took < 3.0, f"said after {took:.1f}s"


async def _start_and_stop(worker: Worker) -> None:
    async with worker:
        pass


async def test_a_worker_under_its_own_credentials_reads_its_pools_given_up_requests(
    hub: Hub,  # noqa: F811
) -> None:
    # A worker under `mesh creds` provisions and reads the hub's MESH_GIVEN_UP (the advisories
    # of requests whose deliveries ran out, cloud_node.given_up), not the advisory subject alone:
    # its credentials carry the stream's calls, and nothing is refused.
    settings = hub.settings("worker-w1")
    async with Connection(settings.nats, "w1") as conn:
        worker = Worker(settings, conn, DeterministicBackend(settings.worker.model))
        async with worker:
            assert worker.given_up._task is not None  # read from the stream
            await conn.subscribed()
            assert not conn.refusals.publishes and not conn.refusals.subscriptions
            operator = hub.settings("operator")
            async with Connection(operator.nats, "op") as op:
                info = await op.jsm().consumer_info("MESH_GIVEN_UP", worker.consumer)
            assert info.num_waiting >= 1  # its pull waits there
