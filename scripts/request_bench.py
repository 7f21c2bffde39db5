"""What a request costs the whole mesh, beside what it costs bare nats-py, counted.

A development tool, not part of the mesh. ``mesh bench paths`` splits each process's CPU into a
part per token and a part per request, but its figures move by 10 to 30% from run to run on a
shared 2-core machine. This runs one path's every part in one process, against one real
nats-server, and with ``--callgrind`` counts the instructions a request costs: the slope
between two request counts, the same run after run to about 1% here.

- ``edge``: the SDK (``MeshClient.stream``), an ``EdgeNode`` and a ``Worker`` on the instant
  test backend, each on its own connection: SDK -> edge -> JetStream -> worker -> edge -> SDK.
  Its floor, ``bare middle``: three bare nats-py connections doing what the bare middle of
  ``mesh bench paths`` does (a client subscribes to an inbox and publishes its request; a middle
  subscribes to an inbox of its own per request and publishes every message it gets there on to
  the client; a worker publishes the tokens and an empty message last).
- ``cloud``: the SDK via the cloud and a ``Worker`` (SDK -> JetStream -> worker -> SDK), against
  ``bare relay``: the bare client and worker alone.

The worker side of both makes its tokens in process (the mesh's instant backend, the bare
worker's loop): what is counted is the mesh's own work. nats-server runs apart and is not
counted. The registry heartbeat, the pull expiry, the loop-lag ticker and a reader's checks
after a quiet spell run rarely here, so that the wall time a request takes (50 times longer
under callgrind) does not count. Both sides settle the garbage collector as a node's process
does once it serves (:func:`mesh.heap.settle`), after their warm-up.

The count does not follow the machine's load as CPU time does, but the work itself follows
timing (how many messages share a write, how many queued requests one pull takes): the same
code read 4.68M and 4.94M instructions a request via an edge in two runs alone. Tell changes
apart by several runs each, or by ``scripts/chain_bench.py`` (the same messages every run)
where a chain is enough.

    python scripts/request_bench.py --path edge --requests 200 --callgrind
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh import heap
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from scripts.callgrind_count import instructions, report

FLOORS = {"edge": "bare middle", "cloud": "bare relay"}
MIDDLE = "bench.request.middle"
WORKER = "bench.request.worker"
Side = Callable[[MeshSettings, int, int, int], Awaitable[float]]
"""Runs ``requests`` requests of ``tokens`` tokens, ``concurrency`` at a time, after a warm-up;
the CPU seconds a request took."""


def _settings(url: str) -> MeshSettings:
    settings = load_settings(
        {
            ("nats", "url"): url,
            ("edge", "edge_id"): "bench",
            ("edge", "http_port"): -1,
            ("stream", "heartbeat"): 20.0,
            ("stream", "node_ttl"): 120.0,
            ("worker", "fetch_timeout"): 5.0,
        },
        environ={},
    )
    settings.worker.model.backend = "deterministic"
    settings.worker.model.slots = 64
    return settings


async def _batches(one: Callable[[int], Awaitable[None]], requests: int, concurrency: int) -> float:
    """``requests`` calls of ``one``, ``concurrency`` at a time; the CPU seconds each took."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(i: int) -> None:
        async with gate:
            await one(i)

    began = time.process_time()
    await asyncio.gather(*(limited(i) for i in range(requests)))
    return (time.process_time() - began) / requests


@contextlib.asynccontextmanager
async def _slow_timers() -> AsyncIterator[None]:
    """Timers that fire by the clock, not by requests, put off: the loop-lag ticker every 5 s
    (it has no setting), and a reader's checks after a quiet spell (a watch on the worker after
    0.25 s, a look at the answer store after 1 s) after 30 s. Under callgrind a request waits
    that long for its answer, and how many of those checks it made would depend on how fast the
    machine ran: the count moved by 7% from one run alone to the next."""
    from mesh import loop_lag, reader

    defaults = loop_lag.LoopLag.__init__.__kwdefaults__
    before = defaults["interval"], reader.WATCH_QUIET_S, reader._QUIET_FIRST_S
    defaults["interval"] = 5.0
    reader.WATCH_QUIET_S = reader._QUIET_FIRST_S = 30.0
    try:
        yield
    finally:
        defaults["interval"], reader.WATCH_QUIET_S, reader._QUIET_FIRST_S = before


async def mesh(path: str, settings: MeshSettings, requests: int, tokens: int, c: int) -> float:
    from cloud_node.worker import Worker
    from edge_node.node import EdgeNode
    from edge_node.routing import create_router
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.client import MeshClient
    from protocol.messages import EndEvent, TokenEvent

    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(_slow_timers())
        wconn = await stack.enter_async_context(Connection(settings.nats, "worker", source=True))
        econn = await stack.enter_async_context(Connection(settings.nats, "edge"))
        backend = DeterministicBackend(settings.worker.model)
        worker = await stack.enter_async_context(Worker(settings, wconn, backend))
        local = DeterministicBackend(settings.worker.model)
        router = create_router(settings.edge.router)
        edge = await stack.enter_async_context(EdgeNode(settings, econn, local, router))
        client = await stack.enter_async_context(
            MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60)
        )
        how = {"route": "cloud"} if path == "edge" else {"via": "cloud"}

        async def one(i: int) -> EndEvent:
            """Read to the stream's end, as ``mesh bench paths`` does: a caller that returned
            at the end event left both of the SDK's generators to asyncio's finalizer hook,
            two ``aclose`` tasks and a wakeup a request that the bare side does not pay."""
            got, end = 0, None
            async for event in client.stream(f"q{i}", max_tokens=tokens, **how):  # type: ignore[arg-type]
                if isinstance(event, TokenEvent):
                    got += 1
                elif isinstance(event, EndEvent):
                    end = event
            assert end is not None, "no end"
            assert got == end.seq, (got, end.seq)  # whole: every position, every token
            assert end.usage.completion_tokens == tokens, end.usage
            return end

        # Until the edge sees the worker, asked without a request: a warm-up of as many requests
        # as that took would differ from run to run, and so would the count.
        model = settings.edge.cloud_model
        for _ in range(1200):
            if edge.nodes.is_live(worker.node_id, model) and not await edge.models.cannot_serve(
                model
            ):
                break
            await asyncio.sleep(0.05)
        for i in range(8):
            assert (await one(-i)).path == "cloud"
        heap.settle()  # as a node's process does once it serves

        async def counted(i: int) -> None:
            end = await one(i)
            assert end.path == "cloud", end.fallback

        return await _batches(counted, requests, c)


async def bare(path: str, settings: MeshSettings, requests: int, tokens: int, c: int) -> float:
    async with contextlib.AsyncExitStack() as stack:
        conns = [
            await stack.enter_async_context(Connection(settings.nats, name))
            for name in ("bare-client", "bare-middle", "bare-worker")
        ]
        client, middle, worker = (conn.nc for conn in conns)
        running: set[asyncio.Task[None]] = set()

        async def generate(msg: object) -> None:
            ask = json.loads(msg.data)  # type: ignore[attr-defined]
            reply = msg.reply  # type: ignore[attr-defined]
            for i in range(ask["max_tokens"]):
                await worker.publish(reply, b" t%d" % i)
            await worker.publish(reply, b"")

        async def on_work(msg: object) -> None:
            task = asyncio.create_task(generate(msg))
            running.add(task)
            task.add_done_callback(running.discard)

        async def on_request(msg: object) -> None:
            to = msg.reply  # type: ignore[attr-defined]

            async def on_back(back: object) -> None:
                await middle.publish(to, back.data)  # type: ignore[attr-defined]
                if not back.data:  # type: ignore[attr-defined]
                    await sub.unsubscribe()

            inbox = middle.new_inbox()
            sub = await middle.subscribe(inbox, cb=on_back)
            await middle.publish(WORKER, msg.data, reply=inbox)  # type: ignore[attr-defined]

        await worker.subscribe(WORKER, cb=on_work)
        await middle.subscribe(MIDDLE, cb=on_request)
        await worker.flush()
        await middle.flush()
        subject = MIDDLE if path == "edge" else WORKER

        async def one(i: int) -> None:
            arrived: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_msg(msg: object) -> None:
                arrived.put_nowait(msg.data)  # type: ignore[attr-defined]

            inbox = client.new_inbox()
            sub = await client.subscribe(inbox, cb=on_msg)
            body = json.dumps({"prompt": f"q{i}", "max_tokens": tokens}).encode()
            await client.publish(subject, body, reply=inbox)
            got = 0
            while await asyncio.wait_for(arrived.get(), 60):
                got += 1
            await sub.unsubscribe()
            assert got == tokens, got

        for i in range(8):
            await one(-i)
        heap.settle()  # the collector as on the mesh's side
        return await _batches(one, requests, c)


SIDES = {"edge": "mesh", "cloud": "mesh", "bare middle": "bare", "bare relay": "bare"}


async def _run(side: str, requests: int, tokens: int, c: int) -> float:
    server = NatsServer(port=-1, ready_timeout=15)
    await server.start()
    try:
        settings = _settings(server.url)
        path = {"bare middle": "edge", "bare relay": "cloud"}.get(side, side)
        run = mesh if SIDES[side] == "mesh" else bare
        return await run(path, settings, requests, tokens, c)
    finally:
        await server.stop()


def _quiet_logs() -> None:
    from mesh.logs import configure_logging

    settings = load_settings({}, environ={})
    configure_logging(settings.log, open(os.devnull, "w"), cache=True)  # noqa: SIM115


def _count(side: str, requests: int, tokens: int, c: int) -> int:
    """Instructions this script runs for ``side`` at ``requests`` under callgrind."""
    args = ["--side", side, "--requests", str(requests), "--tokens", str(tokens)]
    return instructions(__file__, *args, "--concurrency", str(c), "--rounds", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=list(FLOORS), default="edge")
    parser.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=1, help="tokens an answer (default 1)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--callgrind", action="store_true", help="count instructions (valgrind)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    _quiet_logs()
    k, t, c = args.requests, args.tokens, args.concurrency
    if args.side:  # one side (what --callgrind runs)
        each = [asyncio.run(_run(args.side, k, t, c)) for _ in range(args.rounds)]
        print(json.dumps(each))
        return
    sides = [args.path, FLOORS[args.path]]
    if args.callgrind:
        few = max(1, k // 5)
        per = {s: (_count(s, k, t, c) - _count(s, few, t, c)) / (k - few) for s in sides}
        figures = {"instructions_per_request": per, "of_floor": per[sides[0]] / per[sides[1]]}
        unit, shown = "instructions a request", {s: f"{per[s]:,.0f}" for s in sides}
    else:
        spent: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(args.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                spent[side].append(1e3 * asyncio.run(_run(side, k, t, c)))
        best = {s: min(v) for s, v in spent.items()}
        figures = {
            "cpu_ms_per_request": spent,
            "best": best,
            "of_floor": best[sides[0]] / best[sides[1]],
        }
        unit, shown = "CPU ms a request, best of the rounds", {s: f"{best[s]:.3f}" for s in sides}
    title = f"via {args.path}, {k} requests of {t} token(s), {c} at a time ({unit})"
    report(title, shown, figures, args.json)


if __name__ == "__main__":
    main()
