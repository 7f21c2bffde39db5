"""A stopping worker's reservation of its peers' free slots (``mesh.registry.claim_room``,
``Handler.hand_over``, ``Worker.stop``) under least-privilege credentials, a hostile peer, a
link cut mid-claim and an answer ending during the claim. Review S19a found each of these in
the reservation's first form (f53932e); every test failed on it (the comment above each says
what it showed then). Review S19b then found that reservations named in the registry bucket could
be made twice for one slot; peers now promise their slots themselves (``cloud_node.promises``),
and these tests ask them so (a hostile or silent peer answers the reserve ask)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import KeyWrongLastSequenceError

from cloud_node.worker import Worker
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings
from mesh.connection import Connection
from mesh.hub import provision_hub
from mesh.nats_server import NatsServer
from mesh.registry import NodeInfo, claim_room, create_once, handback_key, node_key, open_bucket
from mesh.testing.proxy import TcpProxy
from mesh_app.creds import mint
from protocol.messages import TokenEvent
from protocol.subjects import consumer_name, model_token, worker_reserve_subject
from tests.conftest import make_settings
from tests.helpers import eventually, holds
from tests.test_security import Hub, hub_conf


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[Hub]:
    """The secured hub of tests/test_security.py (operator mode, `mesh creds`), three workers."""
    minted = mint(tmp_path, edges=["site-a"], workers=["w1", "w2", "w3"], expires_in=3600)
    async with NatsServer(config=str(hub_conf(tmp_path, minted))) as server:
        yield Hub(server, minted)


# Before the fix (heal; least privilege): claim_room reserved with nats-py's KeyValue.create, which
# on a key that exists (the slot another stopping worker won) reads the key back with a direct get
# on `$JS.API.DIRECT.GET.KV_mesh_nodes.$KV.mesh_nodes.handback...` to tell a deleted key from a live
# one. A worker's minted creds allow only `$JS.API.DIRECT.GET.KV_mesh_nodes` (the batched read): the
# server logs a Publish Violation per lost slot, the create waits out request_timeout (2 s here, 5 s
# by default), and _create_keys stops at that "failure" without trying the peer's other free slots.
# Two workers stopping at once beside a peer with 4 free slots: under the operator's creds they win
# [1, 3] in 4 ms; under their own, [0, 3] in 2.0 s and 3 violations (one answer drained instead of
# handed over, the stop 2 s late).
async def test_two_stopping_workers_under_minted_creds_reserve_a_peers_slots_quickly(
    hub: Hub,
) -> None:
    settings = hub.settings("worker-w3")
    settings.worker.model.slots = 4
    async with contextlib.AsyncExitStack() as stack:
        peer_conn = await stack.enter_async_context(Connection(settings.nats, "w3"))
        await stack.enter_async_context(
            Worker(settings, peer_conn, DeterministicBackend(settings.worker.model))
        )
        pool = model_token(settings.worker.model.name)
        conns = []
        for node in ("w1", "w2"):
            s = hub.settings(f"worker-{node}")
            conns.append(await stack.enter_async_context(Connection(s.nats, node)))
        began = time.monotonic()
        won = await asyncio.gather(
            claim_room(conns[0], pool, "w1", 3), claim_room(conns[1], pool, "w2", 3)
        )
        took = time.monotonic() - began
        # The hand-back claim (cloud_node.orphans) made the same read-back: now a lost claim
        # is told at once, within the workers' permissions.
        kvs = [await open_bucket(c, settings.stream.node_ttl) for c in conns]
        await create_once(kvs[0], handback_key("anon", "r1", 1))
        lost = time.monotonic()
        with pytest.raises(KeyWrongLastSequenceError):
            await create_once(kvs[1], handback_key("anon", "r1", 1))
        lost = time.monotonic() - lost
    assert hub.violations() == []  # every call within the workers' permissions
    assert sum(won) == 4, won  # each of the peer's 4 free slots promised once
    assert took < 1.0, f"reserving took {took:.2f}s"
    assert lost < 1.0, f"a lost claim was told after {lost:.2f}s"


# -- shared bits for the tests on a server of their own ------------------------------------


def _entry(node: str, pool_model: str, free: int, slots: int = 4) -> bytes:
    info = NodeInfo(node_id=node, role="worker", models=[pool_model], slots=slots, free=free)
    return info.model_dump_json().encode()


async def _peer(conn: Connection, node: str, model: str, free: int, reply: Any) -> Any:
    """A peer's registry entry in ``model``'s pool, and its reserve endpoint answering
    ``reply(msg)`` (None: it hears the ask and never answers)."""
    kv = await open_bucket(conn, 30.0)
    await kv.put(node_key("worker", node, model_token(model)), _entry(node, model, free))

    async def status(msg: Any) -> None:
        answer = await reply(msg)
        if answer is not None:
            await msg.respond(answer)

    return await conn.nc.subscribe(worker_reserve_subject(node), cb=status)


# Before the fix (typed): mesh.registry._free_now parses a peer's status reply with json.loads and
# catches ValueError/AttributeError, not RecursionError: a reply of 100 000 "[" (any process
# that answers `mesh.v1.worker.<id>.status` of a registry entry in the pool; no auth needed on
# an open server) raises RecursionError out of claim_room (which catches MeshError, nats
# errors, TimeoutError, KeyError), out of Handler.hand_over and out of Worker.stop: the stop is
# abandoned half way (no drain, no hand-over, its service and subscriptions left open); under
# the CLI the process ends with a traceback and its answers in flight are cut mid-stream.
async def test_worker_stop_with_a_hostile_peer_status_still_ends_its_answer(
    own_server: NatsServer,
) -> None:
    settings = make_settings(own_server.url, worker__drain_grace=5.0)
    conn = await Connection(settings.nats, "stopping").connect()
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=2, token_delay_ms=20)
    )
    worker = Worker(settings, conn, backend)
    await worker.start()
    client = MeshClient(settings=make_settings(own_server.url), first_event_timeout=10)
    await client.start()
    first = asyncio.Event()
    texts: list[str] = []

    async def ask() -> str:
        async for event in client.stream("[tag:h] go", via="cloud", max_tokens=60):
            if isinstance(event, TokenEvent):
                texts.append(event.text)
                first.set()
        return "".join(texts)

    async def deep(_msg: Any) -> bytes:
        return b"[" * 100_000

    asking = asyncio.ensure_future(ask())
    sub = None
    try:
        await asyncio.wait_for(first.wait(), 10)
        sub = await _peer(conn, "evil", settings.worker.model.name, 2, deep)
        stopped = await asyncio.gather(asyncio.wait_for(worker.stop(), 15), return_exceptions=True)
        text = await asyncio.wait_for(asking, 15)
    finally:
        asking.cancel()
        await asyncio.gather(asking, return_exceptions=True)
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await client.close()
        await conn.close()
    assert list(stopped) == [None], stopped  # the stop ran to its end, no raw exception
    assert text == "".join(f" h{i}" for i in range(60))


# Before the fix (minor; heal): claim_room opens the registry bucket (open_bucket, JetStream's
# STREAM.INFO) outside Connection.while_linked. When the link drops while the stopping worker
# waits on its peers' status replies (up to ASK_S = 0.5 s on a peer that does not answer), the
# open waits out request_timeout (5 s) for a reply that cannot come: claim_room took 5.5 s, not
# ~0.5 s. tests/test_worker_stop.py's promise: "what the stop asked the server ends when the
# link drops".
async def test_a_stopping_worker_cut_off_while_it_asks_its_peers_gives_up_at_once(
    own_server: NatsServer,
) -> None:
    proxy = await TcpProxy(own_server.port).start()
    settings = make_settings(proxy.url)
    settings.nats.reconnect_wait = 0.1
    assert settings.nats.request_timeout >= 5.0  # what a wait on the gone link would cost
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(proxy.stop)
        peers = await stack.enter_async_context(
            Connection(make_settings(own_server.url).nats, "peers")
        )
        conn = await stack.enter_async_context(Connection(settings.nats, "stopping"))

        async def answers_then_link_goes(_msg: Any) -> bytes:
            asyncio.get_running_loop().call_later(0.05, proxy.cut, 30.0)
            return json.dumps({"granted": 1}).encode()

        async def mute(_msg: Any) -> None:
            return None  # hung: hears the ask, never answers (ASK_S)

        for sub in (
            await _peer(peers, "a", "roomy", 3, mute),  # the most room: asked first
            await _peer(peers, "b", "roomy", 2, answers_then_link_goes),
            await _peer(peers, "c", "roomy", 1, mute),  # not asked once the link is gone
        ):
            stack.push_async_callback(sub.unsubscribe)
        began = time.monotonic()
        won = await asyncio.wait_for(claim_room(conn, "roomy", "me", 2), 20)
        took = time.monotonic() - began
    assert won <= 1
    assert took < 1.5, f"claim_room took {took:.2f}s after its link dropped"


async def test_an_answer_that_ends_during_the_claim_does_not_cut_a_last_delivery_short(
    own_server: NatsServer,
) -> None:
    # Before the fix (first rule): Handler.hand_over listed the answers it may hand over, then
    # awaited claim_room (up to ASK_S = 0.5 s on a peer that does not answer at once), then counts
    # what is left to drain as len(inflight) - len(over). An answer of `over` that ended during
    # the claim is no longer in inflight: the count is short by one, reads 0, and the worker
    # stops with a grace of 0. Its other answer, on its queue message's last delivery (which a
    # stopping worker is meant to finish itself), is cut and handed back: the client gets
    # MaxDeliveriesError instead of the answer the worker would have finished in its 5 s grace.
    settings = make_settings(own_server.url, worker__drain_grace=5.0)
    settings.stream.max_deliver = 2
    model = settings.worker.model.name
    slow = ModelSettings(backend="deterministic", slots=2, token_delay_ms=20)
    async with contextlib.AsyncExitStack() as stack:
        conn = await stack.enter_async_context(Connection(settings.nats, "stopping"))
        await provision_hub(conn.jsm(), settings.stream, [model], leases_required=False)
        client = await stack.enter_async_context(
            MeshClient(settings=make_settings(own_server.url), first_event_timeout=10)
        )
        got: dict[str, int] = {"a": 0, "b": 0}

        async def ask(tag: str, tokens: int) -> str:
            texts = []
            async for event in client.stream(f"[tag:{tag}] go", via="cloud", max_tokens=tokens):
                if isinstance(event, TokenEvent):
                    texts.append(event.text)
                    got[tag] += 1
            return "".join(texts)

        # Answer a's first delivery is taken and handed back before the worker starts: the
        # worker serves it on its last delivery (max_deliver 2), and would finish it in its drain.
        long = asyncio.ensure_future(ask("a", 150))
        stack.callback(long.cancel)
        pull = await conn.js.pull_subscribe_bind(consumer_name(model), settings.stream.name)
        taken = await pull.fetch(1, timeout=5)
        await taken[0].nak()
        await pull.unsubscribe()
        worker = Worker(settings, conn, DeterministicBackend(slow))
        await worker.start()
        stack.push_async_callback(worker.stop)
        await eventually(lambda: holds(got["a"] > 0), timeout=10, what="answer a to start")
        assert worker.handler.last_deliveries
        short = asyncio.ensure_future(ask("b", 100))  # 2 s of tokens, on its first delivery
        stack.callback(short.cancel)
        await eventually(lambda: holds(got["b"] > 0), timeout=10, what="answer b to start")
        # A peer with one free slot, and one that hears the ask and never answers (0.5 s).
        peer_settings = make_settings(own_server.url)
        peer_settings.worker.node_id = "roomy-peer"
        peer_settings.stream.max_deliver = 2
        pconn = await stack.enter_async_context(Connection(peer_settings.nats, "peer"))
        peer_model = ModelSettings(backend="deterministic", slots=1, token_delay_ms=20)
        await stack.enter_async_context(
            Worker(peer_settings, pconn, DeterministicBackend(peer_model))
        )

        async def mute(_msg: Any) -> None:
            return None

        sub = await _peer(pconn, "mute-peer", model, 2, mute)
        stack.push_async_callback(sub.unsubscribe)
        # b has 10 tokens (0.2 s) left: it ends while the stop waits on the mute peer.
        await eventually(lambda: holds(got["b"] >= 90), timeout=10, what="answer b near its end")
        assert not short.done()
        await worker.stop()
        texts = await asyncio.wait_for(asyncio.gather(long, short, return_exceptions=True), 15)
    assert texts[1] == "".join(f" b{i}" for i in range(100))
    assert texts[0] == "".join(f" a{i}" for i in range(150)), texts[0]
