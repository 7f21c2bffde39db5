"""An edge reads every escalated answer through one wildcard subscription on its own scope's
token subjects (``mesh/fanout.py``), not one subscription per request. Real nats-server; the
edge tests use workers and edges on the deterministic backend, so every answer is known."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend, Script
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from mesh.fanout import TokenFanout
from protocol.subjects import token_subject
from tests.helpers import eventually


async def test_each_reader_gets_its_own_subjects_messages_and_nothing_else(
    conn: Connection,
) -> None:
    fanout = TokenFanout(conn, "fan")
    await fanout.start()
    got: dict[str, list[bytes]] = {"a1": [], "a2": [], "b": []}

    def reader(name: str):  # type: ignore[no-untyped-def]
        async def on_msg(msg: Msg) -> None:
            got[name].append(msg.data)

        return on_msg

    readers = {name: reader(name) for name in got}
    try:
        assert fanout.covers(token_subject("fan", "r1"))
        assert not fanout.covers(token_subject("other", "r1"))
        fanout.add(token_subject("fan", "r1"), readers["a1"])
        fanout.add(token_subject("fan", "r1"), readers["a2"])  # two readers of one answer
        fanout.add(token_subject("fan", "r2"), readers["b"])
        for subject, data in (
            (token_subject("fan", "r1"), b"one"),
            (token_subject("fan", "r2"), b"two"),
            (token_subject("fan", "r3"), b"nobody's"),
            (token_subject("other", "r1"), b"another scope"),
        ):
            await conn.nc.publish(subject, data)
        await eventually(lambda: _true(all(got.values())), what="each reader's message", timeout=5)
        fanout.remove(token_subject("fan", "r1"), readers["a1"])
        await conn.nc.publish(token_subject("fan", "r1"), b"after")
        await eventually(lambda: _true(len(got["a2"]) == 2), what="the second message", timeout=5)
        assert got == {"a1": [b"one"], "a2": [b"one", b"after"], "b": [b"two"]}
    finally:
        await fanout.stop()
    assert not fanout.covers(token_subject("fan", "r1"))  # stopped: readers subscribe alone


async def _true(value: bool) -> bool:
    return value


async def test_an_edge_escalates_many_requests_on_one_subscription(
    settings: MeshSettings, conn: Connection
) -> None:
    """Twelve concurrent escalations through one edge: each answer exact, and the edge's
    connection never holds more subscriptions than it did idle (before: one more per request
    in flight, each a SUB and an UNSUB on the wire)."""
    cloud = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=12, token_delay_ms=20)
    )
    local = DeterministicBackend(ModelSettings(backend="deterministic", faults=False))
    edge_conn = await Connection(settings.nats, "fanout-edge").connect()
    try:
        async with (
            Worker(settings, conn, cloud),
            EdgeNode(settings, edge_conn, local, HeuristicRouter()),
            MeshClient(settings=settings) as client,
        ):
            idle = len(edge_conn.nc._subs)  # what the server was asked to hold
            most = idle
            done = asyncio.Event()

            async def watch() -> None:
                nonlocal most
                while not done.is_set():
                    most = max(most, len(edge_conn.nc._subs))
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            answers = await asyncio.gather(
                *(
                    client.complete(f"[tag:f{i}] go", route="cloud", max_tokens=20)
                    for i in range(12)
                )
            )
            done.set()
            await watcher
            for i, answer in enumerate(answers):
                assert answer.path == "cloud", answer.end.fallback
                assert answer.text == Script(tag=f"f{i}").answer(20)
            assert most == idle, (idle, most)
    finally:
        await edge_conn.close()
