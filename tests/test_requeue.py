"""A request queued and not started is queued again when its queue was lost under it
(:mod:`mesh.queue_watch`): the pool's consumer gone, or made again since the last look. Never
so that the queue could hold two copies: not after a reconnect that lost nothing, only within
the queue's duplicate window of its first publish (a copy the queue still holds is dropped as a
duplicate), and never once its sender withdrew it. A copy is marked as one, so a worker taking
it numbers its attempt above the original's (``tests/test_two_copies.py``). Real nats-server;
the link goes through a proxy that cuts it. Whole paths (a worker, the SDK, an edge) are in
``tests/test_lost_state.py``."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from nats.js.errors import APIError

import mesh.queue_watch
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import ensure_consumer, provision
from mesh.queue import COPY_HEADER, CloudCall, new_cancel_key
from mesh.queue_watch import LOOK_S, QueueWatch, queue_watch
from mesh.testing.proxy import TcpProxy
from protocol.messages import InferRequest
from protocol.subjects import consumer_name
from tests.conftest import make_settings
from tests.helpers import eventually, holds

WINDOW_S, TIMEOUT_S = 4.0, 1.0
"""The queue's duplicate window, and the request timeout a copy is given on its way: a copy is
sent within WINDOW_S - TIMEOUT_S of the first publish only."""


def _settings(url: str) -> MeshSettings:
    settings = make_settings(url)
    settings.nats.reconnect_wait = 0.05
    settings.nats.request_timeout = TIMEOUT_S
    settings.stream.duplicate_window = WINDOW_S
    settings.stream.answer_max_age = WINDOW_S
    return settings


async def _held(op: Connection, stream: str) -> list[str]:
    """The message ids the queue holds."""
    state = (await op.jsm().stream_info(stream)).state
    ids = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await op.jsm().get_msg(stream, seq)
        except APIError:  # a deleted sequence (or none at all: an empty stream)
            continue
        ids.append((msg.headers or {}).get("Nats-Msg-Id", ""))
    return ids


async def _remade(op: Connection, settings: MeshSettings, *, stream: bool) -> None:
    """The queue deleted under the sender and made again empty (``stream``), or only its pool's
    consumer deleted and made again, as a worker puts them back."""
    if stream:
        await op.jsm().delete_stream(settings.stream.name)
    else:
        await op.jsm().delete_consumer(settings.stream.name, "workers_m")
    await provision(op.jsm(), settings.stream, ["m"])


async def _call(conn: Connection, settings: MeshSettings, rid: str) -> CloudCall:
    request = InferRequest(id=rid, model="m", prompt="hi", cancel_key=new_cancel_key())
    return await CloudCall(conn, settings.stream, request, scope="s1").open()


async def test_a_reconnect_that_lost_nothing_sends_nothing_again(tmp_path: Path) -> None:
    """Before, every request not started was published again after every reconnect (each
    dropped as a duplicate: a burst of every waiting payload as the link came back)."""
    server = await NatsServer(port=-1, store_dir=str(tmp_path / "s"), ready_timeout=15).start()
    proxy = await TcpProxy(server.port).start()
    try:
        settings = _settings(proxy.url)
        async with (
            Connection(settings.nats, "sender") as conn,
            Connection(make_settings(server.url).nats, "operator") as op,
        ):
            await provision(op.jsm(), settings.stream, ["m"])  # a pool, no worker: it waits
            call = await _call(conn, settings, "r1")
            watch = queue_watch(conn, settings.stream)
            await eventually(  # else the next look could not tell what changed, and sends it
                lambda: holds(isinstance(watch._created.get("m"), datetime)),
                what="the watch's first look at the pool",
            )
            drops = conn.reconnects
            proxy.cut(0.2)
            await eventually(lambda: holds(conn.reconnects > drops), what="the reconnect")
            await asyncio.sleep(1.5)  # the watch looked: the queue is the one it was
            assert call._requeuing is None
            assert await _held(op, settings.stream.name) == ["s1.r1"]
            await call.close()
    finally:
        await proxy.stop()
        await server.stop()


async def test_a_queue_made_again_under_a_waiting_request_gets_it_again(
    own_server: NatsServer,
) -> None:
    """No reconnect at all: the stream deleted and made again with the links up (before, the
    request was gone for good). The copy is the one a withdrawal then deletes. A consumer made
    again over a stream that kept the request gets a copy it drops as a duplicate."""
    settings = _settings(own_server.url)
    async with (
        Connection(settings.nats, "sender") as conn,
        Connection(settings.nats, "operator") as op,
    ):
        await provision(op.jsm(), settings.stream, ["m"])
        await op.nc.jetstream().publish("mesh.v1.infer.m.s1", b"{}", headers={"Nats-Msg-Id": "x"})
        call = await _call(conn, settings, "r1")
        assert call.ack is not None and call.ack.seq == 2
        await _remade(op, settings, stream=True)
        began = time.monotonic()

        async def queued_again() -> bool:
            return await _held(op, settings.stream.name) == ["s1.r1"]

        await eventually(queued_again, timeout=5, what="the request queued again")
        took = time.monotonic() - began
        print(f"\nqueue made again: the request was queued again in {took:.2f} s")
        assert call.ack.seq == 1 and call._queued_at + WINDOW_S > time.monotonic()
        copy = await op.jsm().get_msg(settings.stream.name, call.ack.seq)
        assert (copy.headers or {}).get(COPY_HEADER) == "1"  # see tests/test_two_copies.py

        await _remade(op, settings, stream=False)  # the stream kept it: a duplicate, dropped
        await asyncio.sleep(2.5)
        assert await _held(op, settings.stream.name) == ["s1.r1"]

        await call.withdraw()  # deletes the copy, by the copy's own sequence
        await eventually(lambda: _empty(op, settings), what="the copy deleted")
        await call.close()


async def test_no_copy_past_the_window_nor_after_a_withdrawal(own_server: NatsServer) -> None:
    """Past the duplicate window a copy could not be told from the first, and a withdrawn
    request is nobody's to queue: neither is sent again when the queue is made again."""
    settings = _settings(own_server.url)
    async with (
        Connection(settings.nats, "sender") as conn,
        Connection(settings.nats, "operator") as op,
    ):
        await provision(op.jsm(), settings.stream, ["m"])
        late = await _call(conn, settings, "late")
        gone = await _call(conn, settings, "gone")
        await gone.withdraw()
        await asyncio.sleep(max(0.0, late._queued_at + WINDOW_S - TIMEOUT_S - time.monotonic()))
        await _remade(op, settings, stream=True)
        await asyncio.sleep(2.5)  # two looks at least
        assert await _held(op, settings.stream.name) == []
        await late.close()
        await gone.close()


async def _empty(op: Connection, settings: MeshSettings) -> bool:
    return await _held(op, settings.stream.name) == []


class _Waiting:
    """A request waiting unstarted, as the watch sees one (no queue behind it)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.queued_at = time.monotonic()
        self.started = False
        self.requeued = 0

    def requeue(self) -> None:
        self.requeued += 1


async def _looks_over(watch: QueueWatch, seconds: float) -> list[float]:
    """When the watch looked at the pool while one request waited ``seconds`` unstarted (it is
    never queued again: nothing was lost)."""
    looks: list[float] = []
    look_at = watch._look_at

    async def counting(model: str) -> bool:
        looks.append(time.monotonic())
        return await look_at(model)

    watch._look_at = counting  # type: ignore[method-assign]
    call = _Waiting("m")
    watch.add(call)
    await asyncio.sleep(seconds)
    watch.discard(call)
    assert call.requeued == 0
    return looks


async def test_looks_keep_their_pace_while_the_hub_says_no_responders(tmp_path: Path) -> None:
    """A site's leaf says "no responders" to every hub API call while its uplink is down (here:
    a server without JetStream says the same): asking costs nothing, and the hub may come back
    with its queue lost, so looks stay a second apart. Before, each counted as failed and the
    pause doubled to 30 s: a queue lost with the hub was seen tens of seconds late."""
    conf = tmp_path / "plain.conf"
    conf.write_text("port: -1\n")
    server = await NatsServer(config=str(conf)).start()
    try:
        settings = _settings(server.url)
        async with Connection(settings.nats, "sender") as conn:
            looks = await _looks_over(queue_watch(conn, settings.stream), 3.4)
            assert len(looks) >= 4, looks  # at 0, 1, 2 and 3 s
    finally:
        await server.stop()


async def test_a_backlog_in_a_queue_that_stays_the_same_is_looked_at_less_often(
    own_server: NatsServer,
) -> None:
    """Requests that wait seconds in a queue that stays the same lose nothing: looks slow down,
    1, 2 then 4 s apart, not one a second from every connection while the hub is saturated."""
    settings = _settings(own_server.url)
    async with (
        Connection(settings.nats, "sender") as conn,
        Connection(settings.nats, "operator") as op,
    ):
        await provision(op.jsm(), settings.stream, ["m"])
        looks = await _looks_over(queue_watch(conn, settings.stream), 7.5)
        gaps = [round(b - a, 1) for a, b in itertools.pairwise(looks)]
        assert len(looks) <= 5 and gaps[-1] >= 3.5, gaps  # 0, 1, 3, 7 s: before, every second


async def test_only_the_pool_whose_consumer_was_made_is_looked_at(
    own_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JetStream's word that a consumer of the queue was made brings a look at once at its pool
    only. Before, any pool's consumer made (a pool deployed, an operator's ``nats consumer add``)
    made every sender with requests waiting look at every pool, and set its pace back to a look
    a second."""
    monkeypatch.setattr(mesh.queue_watch, "LOOK_S", 60.0)  # no look but the first and the word's
    settings = _settings(own_server.url)
    async with (
        Connection(settings.nats, "sender") as conn,
        Connection(settings.nats, "operator") as op,
    ):
        await provision(op.jsm(), settings.stream, ["m"])
        watch = queue_watch(conn, settings.stream)
        looks: list[str] = []
        look_at = watch._look_at

        async def counting(model: str) -> bool:
            looks.append(model)
            return await look_at(model)

        watch._look_at = counting  # type: ignore[method-assign]
        call = _Waiting("m")
        watch.add(call)
        await eventually(lambda: holds(looks == ["m"] and watch._heard is not None))
        await ensure_consumer(op.jsm(), settings.stream, "other")  # another pool's
        await op.jsm().delete_consumer(settings.stream.name, consumer_name("m"))
        await ensure_consumer(op.jsm(), settings.stream, "m")  # this pool's, made anew
        await eventually(lambda: holds(call.requeued == 1), what="queued again")
        assert looks == ["m", "m"]
        watch.discard(call)


async def test_a_closed_connection_stops_its_watch(own_server: NatsServer) -> None:
    """A request still waiting when its connection closes: the watch stops with it (no timer,
    no look left, no listener), rather than looking on at a closed connection."""
    settings = _settings(own_server.url)
    conn = await Connection(settings.nats, "sender").connect()
    watch = queue_watch(conn, settings.stream)
    watch.add(_Waiting("m"))
    assert watch._looking is not None  # its first look at the pool
    await conn.close()
    assert watch._timer is None and watch._looking is None and watch._undo_loss is None
    await asyncio.sleep(LOOK_S + 0.2)
    assert watch._timer is None and watch._looking is None


async def test_a_watch_whose_word_subscription_got_no_answer_tries_again_at_its_next_look(
    own_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribing to the word that the queue was put back got no answer in time (an election,
    a slow link): the watch tries again at its next look while its requests wait. Before, only
    the next request queued tried again, and requests that kept waiting had the looks alone,
    up to 4 s apart (review S27a)."""
    settings = _settings(own_server.url)
    real = mesh.queue_watch.listen
    tries: list[float] = []

    async def slow_first(*args: Any) -> tuple[Any, bool]:
        tries.append(time.monotonic())
        if len(tries) == 1:
            return None, True  # as `listen` says when the server did not answer in time
        return await real(*args)

    monkeypatch.setattr(mesh.queue_watch, "listen", slow_first)
    async with (
        Connection(settings.nats, "sender") as conn,
        Connection(settings.nats, "operator") as op,
    ):
        await provision(op.jsm(), settings.stream, ["m"])
        watch = queue_watch(conn, settings.stream)
        call = _Waiting("m")
        watch.add(call)  # one request, and no other queued after it
        await eventually(lambda: holds(watch._heard is not None), 3 * LOOK_S, "heard again")
        assert len(tries) == 2, tries
        watch.discard(call)
