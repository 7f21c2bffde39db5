"""A request queued and not started is queued again after a reconnect (the hub may have lost its
store, and the queue with it: ``tests/test_lost_state.py``), but never so that the queue could
hold two copies: only after a reconnect (not when messages were dropped on a live link), only
within the queue's duplicate window of its first publish (a copy the queue still holds is
dropped as a duplicate), and never once its sender withdrew it. Real nats-server; the link
goes through a proxy that cuts it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import provision
from mesh.queue import CloudCall, new_cancel_key
from mesh.testing.proxy import TcpProxy
from protocol.messages import InferRequest
from tests.conftest import make_settings
from tests.helpers import eventually

WINDOW_S, TIMEOUT_S = 3.0, 1.0
"""The queue's duplicate window, and the request timeout a copy is given on its way: a copy is
sent within WINDOW_S - TIMEOUT_S of the first publish only."""


async def _messages(conn: Connection, stream: str) -> tuple[int, int]:
    state = (await conn.jsm().stream_info(stream)).state
    return state.messages, state.last_seq


async def test_a_request_is_queued_again_only_after_a_reconnect_within_its_window(
    tmp_path: Path,
) -> None:
    server = await NatsServer(port=-1, store_dir=str(tmp_path / "s"), ready_timeout=15).start()
    proxy = await TcpProxy(server.port).start()
    try:
        settings = make_settings(proxy.url)
        settings.nats.reconnect_wait = 0.05
        settings.nats.request_timeout = TIMEOUT_S
        settings.stream.duplicate_window = WINDOW_S
        settings.stream.answer_max_age = WINDOW_S
        stream = settings.stream.name
        async with (
            Connection(settings.nats, "sender") as conn,
            Connection(make_settings(server.url).nats, "operator") as op,
        ):
            await provision(op.jsm(), settings.stream, ["m"])  # a pool, no worker: it waits
            request = InferRequest(id="r1", model="m", prompt="hi", cancel_key=new_cancel_key())
            call = CloudCall(conn, settings.stream, request, scope="s1")
            await call.open()
            assert call.ack is not None
            first = call.ack.seq
            assert await _messages(op, stream) == (1, first)

            conn._lost()  # messages dropped on a live link (a slow consumer): no reconnect
            await asyncio.sleep(0.3)
            assert call._requeuing is None

            drops = conn.reconnects
            proxy.cut(0.2)  # within the window: a copy is sent, and dropped as a duplicate
            await eventually(lambda: _is(conn.reconnects > drops), what="the reconnect")
            assert call._requeuing is not None
            await asyncio.wait_for(call._requeuing, 5)
            assert await _messages(op, stream) == (1, first)

            past = call._queued_at + WINDOW_S - TIMEOUT_S - time.monotonic()
            await asyncio.sleep(max(0.0, past))  # past the window: a copy would be a second one
            drops = conn.reconnects
            proxy.cut(0.2)
            await eventually(lambda: _is(conn.reconnects > drops), what="the second reconnect")
            await asyncio.sleep(0.5)
            assert await _messages(op, stream) == (1, first)

            await call.withdraw()  # and once withdrawn, nothing of it is sent again
            assert call._undo_loss is None
            await call.close()
    finally:
        await proxy.stop()
        await server.stop()


async def _is(value: bool) -> bool:
    return value
