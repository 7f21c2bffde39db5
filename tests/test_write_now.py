"""mesh.write_now, through ``Connection.publish_acked`` and the SDK's requests to an edge, against
a real nats-server: a burst of request publishes leaves in groups while the publisher's loop is
still busy; a few publishes wait for the loop's turn, written together."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.write_now import GROUP
from protocol.subjects import edge_infer_subject
from tests.conftest import make_settings
from tests.helpers import ThreadWatcher, eventually


@pytest.fixture
def watcher(nats_server: NatsServer, js_stream: tuple[str, str]) -> Iterator[ThreadWatcher]:
    watching = ThreadWatcher(nats_server.url, f"{js_stream[1]}.>")
    yield watching
    watching.close()


async def _seen(watcher: ThreadWatcher, count: int) -> None:
    async def all_came() -> bool:
        return len(watcher.arrived) >= count

    await eventually(all_came, 5, f"{count} messages at the subscriber")
    assert len(watcher.arrived) == count


async def _warm(conn: Connection, js_stream: tuple[str, str], watcher: ThreadWatcher) -> None:
    """One publish first: the connection's ack inbox is subscribed to on the first."""
    # The watcher subscribed just now, on a socket of its own: a round trip on this connection
    # first (see docs/performance.md, the subscription window).
    await conn.nc.flush()
    await conn.publish_acked(f"{js_stream[1]}.warm", b"w", stream=js_stream[0])
    await _seen(watcher, 1)
    watcher.clear()


async def _burst_while_busy(
    conn: Connection, js_stream: tuple[str, str], watcher: ThreadWatcher, count: int
) -> tuple[list[float], float]:
    """``count`` publishes made in one turn of the loop, with another callback queued behind
    them that holds the loop for 0.3 s (the rest of a burst). Returns when each arrived at a
    subscriber and when the loop was free again."""
    name, subject = js_stream
    freed: list[float] = []

    def busy() -> None:
        time.sleep(0.3)
        freed.append(time.monotonic())

    publishes = [
        asyncio.create_task(conn.publish_acked(f"{subject}.r", f"{i}".encode(), stream=name))
        for i in range(count)
    ]
    asyncio.get_running_loop().call_soon(busy)
    acks = await asyncio.wait_for(asyncio.gather(*publishes), 10)
    assert len({a.seq for a in acks}) == count  # each stored, once
    await _seen(watcher, count)
    return watcher.arrived, freed[0]


async def test_a_group_of_requests_leaves_while_the_loop_is_still_busy(
    conn: Connection, js_stream: tuple[str, str], watcher: ThreadWatcher
) -> None:
    await _warm(conn, js_stream, watcher)
    arrived, freed = await _burst_while_busy(conn, js_stream, watcher, GROUP)
    assert max(arrived) < freed, "the group waited for the busy loop before it was written"


async def test_fewer_than_a_group_go_together_at_the_loops_turn(
    conn: Connection, js_stream: tuple[str, str], watcher: ThreadWatcher
) -> None:
    await _warm(conn, js_stream, watcher)
    arrived, freed = await _burst_while_busy(conn, js_stream, watcher, 3)
    assert min(arrived) > freed  # written once, by nats-py's flusher, when the loop came round


async def test_a_burst_of_sdk_requests_to_an_edge_leaves_in_groups(
    nats_server: NatsServer, conn: Connection
) -> None:
    """The SDK's request to an edge is a core NATS publish (its subscription to the answer's
    inbox goes with it): a burst of them leaves in groups as well, while the client's loop is
    still busy with the rest of its burst."""
    settings = make_settings(nats_server.url)
    watcher = ThreadWatcher(nats_server.url, edge_infer_subject(settings.edge.edge_id))
    try:
        async with MeshClient(settings=settings, connection=conn) as client:
            await conn.nc.flush()  # a round trip after the watcher subscribed
            freed: list[float] = []

            def busy() -> None:
                time.sleep(0.3)
                freed.append(time.monotonic())

            asks = [
                asyncio.create_task(anext(client.stream(f"[tag:g{i}] hi", max_tokens=2)))
                for i in range(GROUP)
            ]
            asyncio.get_running_loop().call_soon(busy)
            await _seen(watcher, GROUP)
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)
    finally:
        watcher.close()
    early = [at for at in watcher.arrived if at < freed[0]]
    # Each request is two messages (its inbox's SUB, its PUB): a group holds GROUP / 2.
    assert len(early) >= GROUP // 2, "the burst waited for the busy loop before it was written"
