"""What an edge writes to a NATS client's inbox: an answer's last tokens and its end in one
write when they reach the edge in one read (``WriteBatch.behind``).

Real nats-server; a worker and an edge on the deterministic backend, each on its own
connection; a plain nats-py client asks the edge as the ``nats`` CLI would (JSON, a reply
subject) and reads the stream. The edge's reads and writes are recorded at its transport.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats
from nats.aio.msg import Msg

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.config import MeshSettings
from mesh.connection import Connection
from tests.test_routing_edges import _det

ROUNDS = 6


def _recorded(transport: Any) -> tuple[list[bytes], list[bytes]]:
    """The bytes ``transport`` reads and writes from now on, one entry a call."""
    reads: list[bytes] = []
    writes: list[bytes] = []
    read, writelines = transport.read, transport.writelines

    async def recorded_read(size: int) -> bytes:
        data: bytes = await read(size)
        reads.append(data)
        return data

    def recorded_writelines(payload: list[bytes]) -> None:
        writes.append(b"".join(payload))
        writelines(payload)

    transport.read, transport.writelines = recorded_read, recorded_writelines
    return reads, writes


async def test_an_answers_last_token_and_its_end_leave_the_edge_in_one_write(
    settings: MeshSettings,
) -> None:
    """Tokens 20 ms apart: the worker writes each alone, and its last one together with the
    end. Where the edge read those two in one read, it relays them to its client in one write
    (before: the token at the loop's turn, the end a task step later; two writes for the edge,
    two reads for nats-server and for the client)."""
    async with (
        Connection(settings.nats, "worker") as wconn,
        Connection(settings.nats, "edge") as econn,
        Worker(settings, wconn, _det("smollm2", 4, token_ms=20)),
        EdgeNode(settings, econn, _det("smollm2", 4), HeuristicRouter()) as edge,
    ):
        nc = await nats.connect(settings.nats.url)
        reads, writes = _recorded(econn.nc._transport)
        together = 0
        try:
            for round_ in range(ROUNDS):
                inbox = nc.new_inbox()
                got: list[dict[str, Any]] = []
                ended = asyncio.Event()

                async def on_msg(
                    msg: Msg, got: list[dict[str, Any]] = got, ended: asyncio.Event = ended
                ) -> None:
                    got.append(json.loads(msg.data))
                    if got[-1]["t"] in ("end", "err"):
                        ended.set()

                sub = await nc.subscribe(inbox, cb=on_msg)
                reads.clear()
                writes.clear()
                ask = {"prompt": f"[tag:r{round_}] hi", "route": "cloud", "stream": True}
                await nc.publish(edge.subject, json.dumps({**ask, "max_tokens": 4}).encode(), inbox)
                await asyncio.wait_for(ended.wait(), 10)
                await sub.unsubscribe()
                texts = "".join(e.get("text", "") for e in got if e["t"] == "tok")
                assert [e["t"] for e in got] == ["start"] + ["tok"] * 4 + ["end"]
                assert texts == f" r{round_}0 r{round_}1 r{round_}2 r{round_}3"
                # The read that brought the answer's end: did it bring the last token too?
                last = f"r{round_}3".encode()
                end_read = next(r for r in reads if b"finish_reason" in r)
                if last not in end_read:
                    continue  # not the case this test is about: they came apart
                together += 1
                to_client = [w for w in writes if inbox.encode() in w]
                with_end = [w for w in to_client if b"finish_reason" in w]
                assert len(with_end) == 1
                assert last in with_end[0], f"round {round_}: the last token and the end left apart"
        finally:
            await nc.close()
        assert together, "the edge never read an answer's last token and its end in one read"


async def test_a_closed_connection_moves_no_write(settings: MeshSettings) -> None:
    """A relay's reader may still get a message in the read loop while its connection drains:
    moving the write batch's write is then nothing to do, not an error in the read loop
    (review S22: ``conn.write_batch`` raises once the connection closed)."""
    conn = Connection(settings.nats, "edge")
    await conn.connect()
    conn.write_behind()  # connected: moves nothing that is not due
    await conn.close()
    conn.write_behind()
