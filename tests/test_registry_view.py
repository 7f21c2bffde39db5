"""An edge follows the node registry without a JetStream consumer (security issue 21): the bucket
republishes every update on ``mesh.v1.reg.<key>``, and a view subscribes to its pool's, then
reads the entries with batched direct gets. Real nats-server processes, no mocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from nats.js import api

import mesh.node_view
import mesh.registry
from cloud_node.promises import PROMISE_S, Promises
from mesh.config import MeshSettings, StreamSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.node_view import NodeView
from mesh.registry import (
    Heartbeat,
    NodeInfo,
    claim_room,
    live_workers,
    node_key,
    open_bucket,
)
from mesh.testing.chaos import Server
from mesh.testing.proxy import TcpProxy
from protocol.errors import UnavailableError
from protocol.subjects import NODES_BUCKET, NODES_STREAM, worker_reserve_subject
from tests.conftest import make_settings
from tests.helpers import eventually


def _info(node: str, model: str = "smollm2", free: int = 1) -> NodeInfo:
    return NodeInfo(node_id=node, role="worker", models=[model], slots=2, free=free)


def _value(node: str, model: str = "smollm2", free: int = 1) -> bytes:
    return _info(node, model, free).model_dump_json().encode()


def _beat(conn: Connection, node: str, model: str = "smollm2", **kw: Any) -> Heartbeat:
    interval, ttl = kw.pop("interval", 0.3), kw.pop("ttl", 3.0)
    return Heartbeat(conn, lambda: _info(node, model), interval, ttl, **kw)


async def _consumers(conn: Connection) -> int:
    return int((await conn.jsm().stream_info(NODES_STREAM)).state.consumer_count or 0)


def _nodes(view: NodeView) -> set[str]:
    return {info.node_id for info in view.live()}


def _is(view: NodeView, node: str, expected: bool) -> Callable[[], Any]:
    async def check() -> bool:
        return (node in _nodes(view)) is expected

    return check


async def test_a_view_creates_no_consumer_and_sees_workers_come_stop_and_die(
    conn: Connection,
) -> None:
    ttl = 2.0
    pool = NodeView(conn, ttl, pool="smollm2")
    everyone = NodeView(conn, ttl)
    await pool.start()  # on no bucket at all: it creates it, with republish
    await everyone.start()
    a, b = _beat(conn, "wa", ttl=ttl), _beat(conn, "wb", "big", ttl=ttl)
    try:
        assert pool.serves("smollm2") is False  # read, and empty: it can tell
        await a.start()
        await b.start()
        await eventually(_is(pool, "wa", True), what="wa seen by its pool")
        await eventually(_is(everyone, "wb", True), what="wb seen by the unfiltered view")
        assert _nodes(pool) == {"wa"}  # another pool's heartbeats never reach it
        assert pool.serves("smollm2") is True and pool.serves("big") is None
        assert everyone.serves("big") is True and pool.is_live("wa", "smollm2") is True
        assert await _consumers(conn) == 0

        # A clean stop deletes the key: gone at once, not after the ttl.
        await a.stop()
        await eventually(_is(pool, "wa", False), timeout=ttl / 2, what="wa's delete")
        assert pool.serves("smollm2") is False

        # A crash: no more heartbeats, no goodbye. It ages out after the ttl.
        await eventually(_is(everyone, "wb", True), what="wb alive")
        assert b._task is not None
        b._task.cancel()
        await eventually(_is(everyone, "wb", False), timeout=ttl + 2, what="wb to age out")
        assert await _consumers(conn) == 0
    finally:
        await b.stop()
        await pool.stop()
        await everyone.stop()


def _redelivery() -> Any:
    """A delivery as the puller takes it, delivered for the second time (an answer handed over)."""
    from nats.aio.msg import Msg

    return Msg(_client=None, subject="x", reply="$JS.ACK.S.C.2.10.12.1700000000000000000.0")  # type: ignore[arg-type]


async def test_stopping_workers_are_promised_each_free_slot_of_a_peer_once(
    conn: Connection,
) -> None:
    """Before the fix (heal): a stopping worker counted its peers' free slots in their entries
    and reserved none, so two stopping at once handed two answers to one free slot. Now each
    peer promises its slots itself (``cloud_node.promises``), once across callers, up to what it
    has free now (an entry is up to a heartbeat old); a worker never asks itself, a peer whose
    engine is down, another pool or a deleted entry; a peer that does not answer promises
    nothing; nobody gets more than it wants. Its own pool: the session's server holds other
    tests' workers, which must not count these."""
    free = {"peer": 3, "me": 5, "down": 4, "gone": 4, "stale": 0}  # what each has free now
    promises = {node: Promises(lambda node=node: free[node]) for node in free}

    async def reserve(msg: Any) -> None:
        await promises[
            next(n for n in free if msg.subject == worker_reserve_subject(n))
        ].on_reserve(msg)

    subs = [await conn.nc.subscribe(worker_reserve_subject(node), cb=reserve) for node in free]
    kv = await open_bucket(conn, 30.0)

    def entry(node: str, free: int, **more: Any) -> bytes:
        info = NodeInfo(node_id=node, role="worker", models=["roomy"], slots=8, free=free, **more)
        return info.model_dump_json().encode()

    for node, said in [("peer", 1), ("me", 5), ("gone", 4), ("stale", 2), ("mute", 2)]:
        await kv.put(node_key("worker", node, "roomy"), entry(node, said))
    await kv.put(node_key("worker", "down", "roomy"), entry("down", 4, down="engine: refused"))
    await kv.put(node_key("worker", "other", "big"), entry("other", 4))
    await kv.delete(node_key("worker", "gone", "roomy"))
    try:
        won = await asyncio.gather(*(claim_room(conn, "roomy", "me", 2) for _ in range(3)))
        assert sum(won) == 3 and max(won) <= 2, won  # three slots, three callers wanting two
        assert await claim_room(conn, "roomy", "me", 2) == 0  # all promised
        assert await claim_room(conn, "roomy", "peer", 9) == 5  # "me"'s; never itself
        promises["peer"].kept(_redelivery())  # the peer took one of its promised slots
        free["peer"] = 2  # and one answer of its own ended
        assert await claim_room(conn, "roomy", "me", 2) == 0  # 2 free, 2 still promised
        assert await claim_room(conn, "roomy", "me", 0) == 0
        assert promises["peer"].grant(5, now=time.monotonic() + PROMISE_S) == 2  # lapsed
    finally:
        for sub in subs:
            await sub.unsubscribe()
        for node in ("peer", "me", "down", "stale", "mute"):
            await kv.delete(node_key("worker", node, "roomy"))


async def test_the_read_pages_skips_claims_and_deleted_keys(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mesh.registry, "SNAPSHOT_BATCH", 3)  # 10 keys: four pages
    kv = await open_bucket(conn, 30.0)
    for i in range(10):
        await kv.put(node_key("worker", f"n{i}", "smollm2"), _value(f"n{i}"))
    await kv.delete(node_key("worker", "n3", "smollm2"))
    await kv.put("handback.scope.r1.1", b"1")  # a claim, not a node
    await kv.put(node_key("worker", "x", "big"), _value("x", "big"))
    view = NodeView(conn, 30.0, pool="smollm2")
    await view.start()
    try:
        expected = {f"n{i}" for i in range(10)} - {"n3"}
        assert view.ready is True and _nodes(view) == expected
        assert {i.node_id for i in await live_workers(conn, "smollm2")} == expected
        assert await live_workers(conn, "none") == []
    finally:
        await view.stop()


async def test_an_update_heard_during_the_read_wins_over_the_older_entry_read(
    conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = await open_bucket(conn, 30.0)
    key = node_key("worker", "w1", "smollm2")
    await kv.put(key, _value("w1", free=2))
    view = NodeView(conn, 30.0, pool="smollm2")
    read = mesh.node_view.read_entries

    async def read_then_a_put_lands(c: Connection, keys: str) -> list[Any]:
        entries = await read(c, keys)  # free=2, read
        await kv.put(key, _value("w1", free=0))  # newer, heard live

        async def heard() -> bool:
            return [i.free for i in view.live()] == [0]

        await eventually(heard, what="the live update")
        return entries  # the older entry arrives after the newer update

    monkeypatch.setattr(mesh.node_view, "read_entries", read_then_a_put_lands)
    await view.start()
    try:
        assert [i.free for i in view.live()] == [0]
    finally:
        await view.stop()


async def test_a_bucket_without_republish_keeps_a_view_not_ready_until_a_worker_adds_it(
    conn: Connection, settings: MeshSettings
) -> None:
    # The bucket as an older version created it: no republish, no direct gets.
    await conn.js.create_key_value(
        api.KeyValueConfig(bucket=NODES_BUCKET, history=1, ttl=3.0, storage=api.StorageType.FILE)
    )
    view = NodeView(conn, 3.0, pool="smollm2")
    with pytest.raises(UnavailableError, match="lacks republish and allow_direct"):
        await view.start()
    beat = _beat(conn, "w1", stream=StreamSettings())  # a writer: it updates the bucket
    try:
        assert view.ready is False and view.serves("smollm2") is None
        assert conn.restoring == ["registry watch"]  # readiness says what it waits for
        await beat.start()
        config = (await conn.jsm().stream_info(NODES_STREAM)).config
        assert config.allow_direct is True and config.republish is not None
        assert config.republish.dest == "mesh.v1.reg.>"

        async def serves() -> bool:
            return view.serves("smollm2") is True

        await eventually(serves, what="the view to follow the bucket by itself")

        async def restored() -> bool:  # its step's end is filed a loop turn after the read
            return conn.restoring == []

        await eventually(restored, timeout=2, what="the step to end")
        assert await _consumers(conn) == 0
    finally:
        await beat.stop()
        await view.stop()


async def test_a_view_reads_the_registry_again_after_a_server_restart(tmp_path: Path) -> None:
    """The view's link comes back later than the worker's: what changed meanwhile (a worker
    that announced itself once, with no heartbeat since) it learns from the read after its
    reconnect; then live updates flow again (a clean stop is seen at once)."""
    ttl = 5.0
    server = Server(tmp_path / "store")
    await server.start()
    proxy = await TcpProxy(server.port).start()
    worker_settings = make_settings(server.url)
    edge_settings = make_settings(proxy.url)
    edge_settings.nats.reconnect_wait = 0.1
    worker_settings.nats.reconnect_wait = 0.1
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(server.stop)
        stack.push_async_callback(proxy.stop)
        wconn = await stack.enter_async_context(Connection(worker_settings.nats, "worker"))
        vconn = await stack.enter_async_context(Connection(edge_settings.nats, "edge"))
        a = _beat(wconn, "wa", interval=0.5, ttl=ttl, stream=StreamSettings())
        await a.start()
        stack.push_async_callback(a.stop)
        view = NodeView(vconn, ttl, pool="smollm2")
        await view.start()
        stack.push_async_callback(view.stop)
        await eventually(_is(view, "wa", True), what="wa seen")

        proxy.cut(4.0)  # the view stays cut off a while after the server is back
        await server.restart(outage=0.5)

        async def announced_once() -> bool:
            with contextlib.suppress(Exception):
                kv = await open_bucket(wconn, ttl)
                await kv.put(node_key("worker", "wb", "smollm2"), _value("wb"))
                return True
            return False

        await eventually(announced_once, what="wb to announce itself once")
        assert vconn.reconnects == 0 and "wb" not in _nodes(view)
        await eventually(_is(view, "wb", True), timeout=ttl, what="wb read after the reconnect")
        assert vconn.reconnects >= 1

        async def ready() -> bool:
            return view.ready and view.is_live("wa", "smollm2") is True

        await eventually(ready, timeout=ttl + 5, what="the view ready again")
        assert await _consumers(wconn) == 0
        await a.stop()
        await eventually(_is(view, "wa", False), timeout=ttl / 2, what="wa's delete, live")


# -- permissions: what an edge and a worker need now -----------------------------------------
EDGE_PUB = ("$JS.API.STREAM.INFO.KV_mesh_nodes", "$JS.API.DIRECT.GET.KV_mesh_nodes")
EDGE_SUB = ("mesh.v1.reg.worker.>", "_INBOX.>")
WORKER_PUB = (
    *(f"$JS.API.STREAM.{op}.KV_mesh_nodes" for op in ("INFO", "CREATE", "UPDATE")),
    "$JS.API.DIRECT.GET.KV_mesh_nodes",
    "$KV.mesh_nodes.worker.*.w1",
)


def _user(name: str, pub: tuple[str, ...], sub: tuple[str, ...]) -> str:
    def quoted(subjects: tuple[str, ...]) -> str:
        return ", ".join(f'"{s}"' for s in subjects)

    return (
        f"{{ user: {name}, password: pw, permissions: {{ "
        f"publish: {{ allow: [{quoted(pub)}] }}, subscribe: {{ allow: [{quoted(sub)}] }} }} }}"
    )


@pytest.fixture
async def locked_server(tmp_path: Path) -> AsyncIterator[NatsServer]:
    conf = tmp_path / "hub.conf"
    conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        "authorization { users = [\n"
        f"  {_user('edge', EDGE_PUB, EDGE_SUB)},\n"
        f"  {_user('worker', WORKER_PUB, ('_INBOX.>',))},\n"
        "  { user: admin, password: pw }\n"
        "] }\n"
    )
    async with NatsServer(config=str(conf)) as server:
        yield server


def _as(server: NatsServer, user: str) -> MeshSettings:
    settings = make_settings(server.url)
    settings.nats.user, settings.nats.password = user, "pw"
    return settings


async def test_an_edge_follows_the_registry_with_no_consumer_rights(
    locked_server: NatsServer,
) -> None:
    """The edge may only read the bucket's config, direct-get it and hear its updates; the
    worker may only write its key, create or update the bucket and direct-get it."""
    async with contextlib.AsyncExitStack() as stack:
        conns = {
            user: await stack.enter_async_context(Connection(_as(locked_server, user).nats, user))
            for user in ("edge", "worker", "admin")
        }
        beat = _beat(conns["worker"], "w1", ttl=3.0, stream=StreamSettings())
        await beat.start()
        stack.push_async_callback(beat.stop)
        view = NodeView(conns["edge"], 3.0, pool="smollm2")
        await view.start()
        stack.push_async_callback(view.stop)
        await eventually(_is(view, "w1", True), what="w1 seen by a locked-down edge")
        assert view.serves("smollm2") is True
        assert [i.node_id for i in await live_workers(conns["worker"], "smollm2")] == ["w1"]
        assert await _consumers(conns["admin"]) == 0
        await beat.stop()
        await eventually(_is(view, "w1", False), timeout=1.5, what="w1's delete")


async def test_a_worker_found_gone_is_forgotten_until_it_announces_itself_again(
    conn: Connection,
) -> None:
    """The server said nobody listens for it: the view forgets it now, not after the ttl. Its
    old entry, read again (as after a reconnect), does not bring it back; a new one does."""
    kv = await open_bucket(conn, 30.0)
    key = node_key("worker", "w1", "smollm2")
    await kv.put(key, _value("w1"))
    await kv.put(node_key("worker", "w2", "smollm2"), _value("w2"))
    view = NodeView(conn, 30.0, pool="smollm2")
    await view.start()
    try:
        assert _nodes(view) == {"w1", "w2"}
        view.gone("w1")
        assert _nodes(view) == {"w2"} and view.serves("smollm2") is True
        view.gone("w2")
        assert view.serves("smollm2") is False
        await view._sync()  # the entries read again (as after a reconnect): old news
        assert _nodes(view) == set()
        await kv.put(key, _value("w1"))  # w1 was there after all: its next heartbeat
        await eventually(_is(view, "w1", True), what="w1 back with its next heartbeat")
        assert view.serves("smollm2") is True
    finally:
        await view.stop()


async def test_a_worker_found_gone_comes_back_in_a_recreated_bucket(own_server: NatsServer) -> None:
    """The bucket recreated (a hub restarted with an empty store, ``nats kv rm``) numbers its
    entries from 1 again: a worker found gone before is seen again once its "old news" mark ends
    (the ttl, when the old bucket would have aged out every entry written before it). Before,
    its new entries were taken for old ones until their sequence passed the old bucket's: for
    as long as the old bucket had lived."""
    ttl = 1.0
    async with Connection(make_settings(own_server.url).nats, "view") as conn:
        kv = await open_bucket(conn, ttl)
        key = node_key("worker", "w1", "smollm2")
        for _ in range(300):  # a bucket that lived a while: its sequence is far ahead
            await kv.put(key, _value("w1"))
        view = NodeView(conn, ttl, pool="smollm2")
        await view.start()
        try:
            assert _nodes(view) == {"w1"}
            view.gone("w1")
            await conn.jsm().delete_stream(NODES_STREAM)
            kv = await open_bucket(conn, ttl)

            async def seen() -> bool:
                await kv.put(key, _value("w1"))  # its heartbeat, into the new bucket
                return "w1" in _nodes(view)

            await eventually(seen, timeout=5, what="w1 seen in the new bucket")
        finally:
            await view.stop()


async def test_a_heartbeat_stops_even_when_its_put_ends_in_the_turn_of_the_stop(
    conn: Connection,
) -> None:
    """The stop's cancel lands in the very loop turn the heartbeat's put is answered. On Python
    3.11 the ``asyncio.wait_for`` around the put then returns the put's result instead of the
    cancel, and a loop that did not look again beat on, with its stop waiting for it for ever:
    a SIGTERMed worker streamed on and never exited (CI, the worker hand-over chaos test)."""
    beat = _beat(conn, "w1", interval=0.05)
    await beat.start()
    assert beat._kv is not None
    real_put = beat._kv.put
    stopping: list[asyncio.Task[None]] = []

    async def put_then_stop(key: str, value: bytes) -> int:
        seq = await real_put(key, value)
        # The stop's first step (its cancel) runs before wait_for sees the put done.
        stopping.append(asyncio.ensure_future(beat.stop()))
        return seq

    beat._kv.put = put_then_stop  # type: ignore[method-assign]

    async def stop_began() -> bool:
        return bool(stopping)

    await eventually(stop_began, timeout=5)
    done, _ = await asyncio.wait(stopping, timeout=5)
    assert done, "the heartbeat's stop did not return"
    assert beat._task is not None and beat._task.done()
    assert await live_workers(conn) == []  # and it said goodbye


async def test_a_view_forgets_workers_long_dead(conn: Connection) -> None:
    """Each worker that died (an id new at each start: ``worker-<host>-<pid>``) left its entry
    in every edge's view for as long as the edge ran; a view now forgets a node not heard from
    for ten ttls, when a new one comes."""
    kv = await open_bucket(conn, 30.0)
    await kv.put(node_key("worker", "dead", "smollm2"), _value("dead"))
    view = NodeView(conn, 0.2, pool="smollm2")
    await view.start()
    try:
        held = lambda: {info.node_id for info, _seen in view._nodes.values()}  # noqa: E731
        assert held() == {"dead"}  # read at the start
        await asyncio.sleep(10 * 0.2 + 0.1)  # ten ttls, not a word from it
        await kv.put(node_key("worker", "new", "smollm2"), _value("new"))
        await eventually(_is(view, "new", True), what="the new worker seen")
        assert held() == {"new"}
    finally:
        await view.stop()


async def test_a_bucket_an_edge_makes_has_the_hub_s_replicas(
    conn: Connection, settings: MeshSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edge back before any worker (a hub restarted on empty stores) makes the registry's
    bucket: with one replica, where a worker makes it with the hub's, and no worker raised it
    after (its put into the bucket succeeds). A single server cannot hold three replicas: the
    settings the bucket is made with are what is checked."""
    with contextlib.suppress(Exception):
        await conn.jsm().delete_stream(NODES_STREAM)
    made: list[StreamSettings | None] = []
    real = mesh.node_view.open_bucket

    async def recording(conn: Connection, ttl: float, stream: StreamSettings | None = None) -> Any:
        made.append(stream)
        return await real(conn, ttl, stream)

    monkeypatch.setattr(mesh.node_view, "open_bucket", recording)
    view = NodeView(conn, 3.0, pool="smollm2", stream=settings.stream)
    await view.start()
    await view.stop()
    assert made == [settings.stream]
