"""The per-token chains of a worker, an edge and the SDK, each beside its floor, counted.

A development tool, not part of the mesh. On a shared 2-core machine, CPU figures of a whole
mesh move by 10 to 30% from run to run (``mesh bench paths``, ``scripts/ab_bench.py``); this
runs one role's chain alone in one process, fed the same input each time, and with
``--callgrind`` counts the instructions it runs: the same count run after run (within 0.2%
here), so a change of 2% shows.

- ``edge``: an edge's relay (``CloudRelay`` reading the answer, its record, a client's
  ``NatsSink``, the write batch) against the bare middle of ``mesh bench paths`` (a nats-py
  subscription whose callback publishes each message again).
- ``sdk``: ``MeshClient.stream`` via the cloud against a bare nats-py reader (a callback that
  puts each message on a queue a task reads).
- ``worker``: a worker's HTTP backend, ``generate_into`` and its publisher against the bare
  relay of ``mesh bench paths`` (aiohttp's SSE lines, one ``publish`` per token), both reading
  the deterministic OpenAI-compatible server, run in the same process (its share is in both).

The edge and SDK chains start where nats-py parses a message: the worker's events are built
here and handed to the client's parser (``nc._ps.parse``) one at a time, each followed by three
turns of the event loop; what they publish goes to a real nats-server, every write at the
loop's turn (``write_gap_ms`` 0, as nats-py writes for the floors). The worker's engine sends a
token every millisecond. Without ``--callgrind`` each side runs ``--rounds`` times in
turn and the CPU time per token is printed (best of the rounds); with it, each side runs under
``valgrind --tool=callgrind`` at two lengths and the instructions per token are the slope.

    python scripts/chain_bench.py --role edge --tokens 2000 --callgrind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.provision import provision
from protocol.codec import WireFormat, dump_event, dump_token
from protocol.messages import EndEvent, InferRequest, RouteDecision, TokenEvent, Usage
from protocol.stream import AnswerWriter
from scripts.callgrind_count import instructions, report

FLOORS = {"edge": "bare middle", "sdk": "bare reader", "worker": "bare relay"}
Chain = Callable[[Connection, MeshSettings, int], Awaitable[float]]
"""Runs one side's chain for that many tokens; the CPU seconds the tokens took."""


def frame(subject: str, sid: int, data: bytes) -> bytes:
    """A NATS ``MSG`` as the server sends it."""
    return b"MSG %s %d %d\r\n%s\r\n" % (subject.encode(), sid, len(data), data)


async def feed(conn: Connection, frames: list[bytes]) -> float:
    """Hand ``frames`` to the client's parser one at a time, three loop turns after each; the
    CPU seconds it took."""
    parse = conn.nc._ps.parse
    began = time.process_time()
    for data in frames:
        await parse(data)
        for _ in range(3):
            await asyncio.sleep(0)
    return time.process_time() - began


async def _new_sub(conn: Connection, prefix: str, before: set[int]) -> tuple[str, int]:
    """The subject and sid of the subscription on ``prefix`` made since ``before``."""
    for _ in range(1000):
        for sid, sub in conn.nc._subs.items():
            if sid not in before and sub.subject.startswith(prefix):
                return sub.subject, sid
        await asyncio.sleep(0.005)
    raise RuntimeError(f"no subscription on {prefix}")


def _answer(qid: str, subject: str, sid: int, tokens: int) -> tuple[bytes, list[bytes], bytes]:
    """A worker's start, tokens and end for queued request ``qid``, as messages."""
    writer = AnswerWriter(qid, attempt=1, node="worker.w1")
    start = frame(subject, sid, dump_event(writer.start(), WireFormat.MSGPACK))
    frames = []
    for i in range(tokens):
        text = f" t{i}"
        writer.token(text)
        frames.append(frame(subject, sid, dump_token(qid, i, text, 1, WireFormat.MSGPACK)))
    end = writer.end(finish_reason="length", usage=Usage(completion_tokens=tokens))
    return start, frames, frame(subject, sid, dump_event(end, WireFormat.MSGPACK))


class _CloudAlways:
    """The edge's view of the cloud, for the edge chain: it serves, and its worker lives."""

    async def cannot_serve(self, model: str) -> None:
        return None

    def ask_workers(self, model: str) -> None:
        return None

    def no_live_worker(self, model: str) -> None:
        return None

    def is_live(self, worker: str, model: str) -> bool:
        return True


async def edge(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    from edge_node.parts import EdgeCounts
    from edge_node.records import NatsSink, Records
    from edge_node.relay import CloudRelay, RelayParts
    from mesh.tasks import TaskSet
    from mesh.tracing import Tracing

    cloud = _CloudAlways()
    parts = RelayParts(
        conn=conn,
        edge_id="chain",
        scope="chain",
        edge=settings.edge,
        stream=settings.stream,
        worker=settings.worker,
        models=cloud,  # type: ignore[arg-type]
        nodes=cloud,  # type: ignore[arg-type]
        tracing=Tracing(settings.log.otel),
        counts=EdgeCounts(),
        withdrawals=TaskSet("chain-withdrawals"),
    )
    request = InferRequest(prompt="chain", max_tokens=tokens, stream=True, model="smollm2")
    record, _ = Records(60).open("client", request.id, lambda: "fingerprint")
    sink = NatsSink(conn, "_INBOX.chain.x", request.id, WireFormat.MSGPACK, streaming=True)
    record.sinks.append(sink)
    relay = CloudRelay(
        parts, request, RouteDecision(decision="cloud", reason="chain"), record, 0.0, None
    )
    before = set(conn.nc._subs)
    task = asyncio.create_task(relay.run())
    subject, sid = await _new_sub(conn, "mesh.v1.tok.", before)
    await asyncio.sleep(0.2)  # the queued request's ack
    start, frames, end = _answer(subject.rsplit(".", 1)[1], subject, sid, tokens)
    await feed(conn, [start])
    spent = await feed(conn, frames)
    await feed(conn, [end])
    await asyncio.wait_for(task, 10)
    assert record.done, record.state.missing()
    assert record.state.positions == tokens, record.state.missing()
    return spent


async def bare_middle(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    nc = conn.nc
    done = asyncio.Event()

    async def again(msg: object) -> None:
        data = msg.data  # type: ignore[attr-defined]
        await nc.publish("_INBOX.chain.x", data)
        if not data:
            done.set()

    sub = await nc.subscribe("_INBOX.middle.y", cb=again)
    frames = [frame(sub.subject, sub._id, b" t%d" % i) for i in range(tokens)]
    spent = await feed(conn, frames)
    await feed(conn, [frame(sub.subject, sub._id, b"")])
    await asyncio.wait_for(done.wait(), 10)
    await sub.unsubscribe()
    return spent


async def sdk(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    from mesh.client import MeshClient

    texts: list[str] = []
    async with MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as client:

        async def read() -> None:
            async for event in client.stream("chain", via="cloud", max_tokens=tokens):
                if isinstance(event, TokenEvent):
                    texts.append(event.text)
                elif isinstance(event, EndEvent):
                    return

        nc = client.conn
        before = set(nc.nc._subs)
        task = asyncio.create_task(read())
        subject, sid = await _new_sub(nc, "mesh.v1.tok.", before)
        await asyncio.sleep(0.2)
        start, frames, end = _answer(subject.rsplit(".", 1)[1], subject, sid, tokens)
        await feed(nc, [start])
        spent = await feed(nc, frames)
        await feed(nc, [end])
        await asyncio.wait_for(task, 10)
    assert len(texts) == tokens, len(texts)
    return spent


async def bare_reader(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    arrived: asyncio.Queue[bytes] = asyncio.Queue()
    got = 0

    async def on_msg(msg: object) -> None:
        arrived.put_nowait(msg.data)  # type: ignore[attr-defined]

    async def read() -> None:
        nonlocal got
        while await arrived.get():
            got += 1

    sub = await conn.nc.subscribe("_INBOX.reader.y", cb=on_msg)
    task = asyncio.create_task(read())
    frames = [frame(sub.subject, sub._id, b" t%d" % i) for i in range(tokens)]
    spent = await feed(conn, frames)
    await feed(conn, [frame(sub.subject, sub._id, b"")])
    await asyncio.wait_for(task, 10)
    await sub.unsubscribe()
    assert got == tokens, got
    return spent


async def _engine(settings: MeshSettings) -> tuple[str, Callable[[], Awaitable[None]]]:
    """The deterministic OpenAI-compatible server in this process, a token a millisecond."""
    from aiohttp import web

    from mesh.testing.openai_server import DeterministicServer

    runner = web.AppRunner(DeterministicServer("smollm2", prefill_ms=0, token_ms=1).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return f"http://127.0.0.1:{port}/v1", runner.cleanup


STREAMS = 4
"""Answers a worker-side run streams at once."""
ANSWERS = {"worker": STREAMS, "bare relay": STREAMS}
"""Answers a side streams in one run (1 where not named)."""


async def worker(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    from cloud_node.publisher import AnswerPublisher
    from mesh.answer_store import AnswerStore
    from mesh.backends.openai_http import OpenAIHTTPBackend
    from mesh.generate import generate_into

    url, stop = await _engine(settings)
    model = settings.worker.model.model_copy(update={"base_url": url})
    ws = settings.worker.model_copy(update={"coalesce_ms": 0.5})  # tokens 1 ms apart: one each
    backend = OpenAIHTTPBackend(model)
    await backend.start()
    store = AnswerStore(conn, settings.stream)

    async def one(index: int) -> None:
        request = InferRequest(id=f"w{index}", prompt="chain", max_tokens=tokens, model="smollm2")
        publisher = AnswerPublisher(conn, store, "chain", request.id, WireFormat.MSGPACK, timeout=5)
        writer = AnswerWriter(request.id, attempt=1, node="worker.w1")
        await publisher.send(writer.start())
        take = getattr(publisher, "send_now", publisher.send)  # an older tree has no send_now
        await generate_into(backend, request, writer, take, ws)
        assert writer.seq == tokens, writer.seq

    try:
        began = time.process_time()
        await asyncio.gather(*(one(i) for i in range(STREAMS)))
        await conn.flush_write_batch()
        return (time.process_time() - began) / STREAMS
    finally:
        await backend.close()
        await stop()


async def bare_relay(conn: Connection, settings: MeshSettings, tokens: int) -> float:
    import aiohttp

    from mesh_app.bench.bare import deltas as _deltas

    url, stop = await _engine(settings)
    nc = conn.nc

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "chain"}],
            "max_tokens": tokens,
            "stream": True,
        }
        got = 0
        async with session.post(f"{url}/chat/completions", json=body) as resp:
            async for raw in resp.content:
                for text in _deltas(raw):
                    await nc.publish(f"bare.chain.{index}", text.encode())
                    got += 1
        await nc.publish(f"bare.chain.{index}", b"")
        assert got == tokens, got

    try:
        async with aiohttp.ClientSession() as session:
            began = time.process_time()
            await asyncio.gather(*(one(session, i) for i in range(STREAMS)))
            return (time.process_time() - began) / STREAMS
    finally:
        await stop()


CHAINS: dict[str, Chain] = {
    "edge": edge,
    "bare middle": bare_middle,
    "sdk": sdk,
    "bare reader": bare_reader,
    "worker": worker,
    "bare relay": bare_relay,
}


async def _run(sides: list[str], tokens: int, rounds: int) -> dict[str, list[float]]:
    """Each side ``rounds`` times, in turn, against one nats-server: CPU us per token."""
    server = NatsServer(port=-1, ready_timeout=15)
    await server.start()
    # Every write at the loop's turn, as nats-py's flusher writes for the floors: fed faster
    # than a real stream, the write batch would put many tokens in one write, which a floor
    # cannot, and the chains would not compare.
    settings = load_settings({("nats", "url"): server.url, ("nats", "write_gap_ms"): 0}, environ={})
    spent: dict[str, list[float]] = {side: [] for side in sides}
    try:
        async with Connection(settings.nats, "chain") as conn:
            await provision(conn.jsm(), settings.stream, [settings.edge.cloud_model])
            for r in range(rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    seconds = await CHAINS[side](conn, settings, tokens)
                    spent[side].append(1e6 * seconds / tokens)
    finally:
        await server.stop()
    return spent


def _count(side: str, tokens: int) -> int:
    """Instructions this script runs for ``side`` at ``tokens`` under callgrind."""
    return instructions(__file__, "--side", side, "--tokens", str(tokens), "--rounds", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["edge", "sdk", "worker"], default="edge")
    parser.add_argument("--side", choices=list(CHAINS), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--callgrind", action="store_true", help="count instructions (valgrind)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.side:  # one side, once (what --callgrind runs)
        spent = asyncio.run(_run([args.side], args.tokens, args.rounds))
        print(json.dumps(spent))
        return
    sides = [args.role, FLOORS[args.role]]
    if args.callgrind:
        short = max(1, args.tokens // 5)
        per = {
            side: (_count(side, args.tokens) - _count(side, short))
            / ((args.tokens - short) * ANSWERS.get(side, 1))
            for side in sides
        }
        figures = {"instructions_per_token": per, "of_floor": per[sides[0]] / per[sides[1]]}
        unit, shown = "instructions a token", {side: f"{per[side]:,.0f}" for side in sides}
    else:
        spent = asyncio.run(_run(sides, args.tokens, args.rounds))
        best = {side: min(values) for side, values in spent.items()}
        ratio = best[sides[0]] / best[sides[1]]
        figures = {"cpu_us_per_token": spent, "best": best, "of_floor": ratio}
        unit, shown = "CPU us a token, best of the rounds", {s: f"{best[s]:.1f}" for s in sides}
    report(f"{args.role} chain, {args.tokens} tokens ({unit})", shown, figures, args.json)


if __name__ == "__main__":
    main()
