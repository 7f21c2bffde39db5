"""The CPU a request costs a whole path, for two checkouts taking turns in one run.

A development tool, not part of the mesh. ``scripts/ab_bench.py`` splits each process's CPU into
a part per token and a part per request from two answer lengths, a fit that moves by 10 to 30%
here; and ``scripts/request_bench.py`` runs this tree only. This runs one path's every part
(the SDK, and a ``Worker`` on the deterministic backend, and with ``--path edge`` an
``EdgeNode`` between them) in one process against its own nats-server, one-token answers,
``--concurrency`` at a time: the CPU a request is then almost all the fixed part. Each run is a
child process that imports the mesh from its tree (``PYTHONPATH``), so any commit whose
``Worker``, ``EdgeNode`` and ``MeshClient`` take the same arguments as today's can be set beside
this one (``git worktree add /tmp/a <commit>``); the trees take turns, A first in odd rounds.

    python scripts/tree_bench.py --a-tree /tmp/a --path edge --requests 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def _quiet_logs() -> None:
    """Log lines written as a node writes them, to nowhere."""
    from mesh.config import load_settings
    from mesh.logs import configure_logging

    quiet = load_settings({}, environ={}).log
    try:
        configure_logging(quiet, open(os.devnull, "w"), cache=True)  # noqa: SIM115
    except TypeError:  # a tree from before the logger cache
        configure_logging(quiet, open(os.devnull, "w"))  # noqa: SIM115


async def _child(path: str, requests: int, concurrency: int) -> float:
    """CPU seconds a request, of this process, with the mesh imported from ``PYTHONPATH``."""
    from cloud_node.worker import Worker
    from edge_node.node import EdgeNode
    from edge_node.routing import create_router
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.client import MeshClient
    from mesh.config import load_settings
    from mesh.connection import Connection
    from mesh.nats_server import NatsServer
    from protocol.messages import EndEvent

    server = NatsServer(port=-1, ready_timeout=15)
    await server.start()
    try:
        settings = load_settings(
            {
                ("nats", "url"): server.url,
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
        how: dict[str, Any] = {"route": "cloud"} if path == "edge" else {"via": "cloud"}
        async with contextlib.AsyncExitStack() as stack:
            wconn = await stack.enter_async_context(Connection(settings.nats, "worker"))
            backend = DeterministicBackend(settings.worker.model)
            await stack.enter_async_context(Worker(settings, wconn, backend))
            if path == "edge":
                econn = await stack.enter_async_context(Connection(settings.nats, "edge"))
                local = DeterministicBackend(settings.worker.model)
                router = create_router(settings.edge.router)
                await stack.enter_async_context(EdgeNode(settings, econn, local, router))
            client = await stack.enter_async_context(
                MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60)
            )

            async def one(i: int) -> EndEvent:
                end = None
                async for event in client.stream(f"q{i}", max_tokens=1, **how):
                    if isinstance(event, EndEvent):
                        end = event
                assert end is not None, "no end"
                return end

            for i in range(600):  # until the edge sees the worker: answers come from the cloud
                if (await one(-1 - i)).path == "cloud":
                    break
                await asyncio.sleep(0.05)
            for i in range(20):
                assert (await one(-1000 - i)).path == "cloud"
            gate = asyncio.Semaphore(concurrency)

            async def limited(i: int) -> None:
                async with gate:
                    assert (await one(i)).path == "cloud"

            import gc

            gc.collect()
            gc.freeze()  # what a node's process does once it serves, whichever tree
            began = time.process_time()
            await asyncio.gather(*(limited(i) for i in range(requests)))
            return (time.process_time() - began) / requests
    finally:
        await server.stop()


def _run(tree: str, path: str, requests: int, concurrency: int) -> float:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
    args = ["--child", tree, "--path", path, "--requests", str(requests)]
    out = subprocess.run(
        [sys.executable, str(HERE), *args, "--concurrency", str(concurrency)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"the run of {tree} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a-tree", help="checkout of version A (B is this tree)")
    parser.add_argument("--path", choices=("cloud", "edge"), default="cloud")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.child:
        _quiet_logs()
        print(asyncio.run(_child(args.path, args.requests, args.concurrency)))
        return
    if not args.a_tree:
        parser.error("--a-tree is required")
    trees = {"A": str(Path(args.a_tree).resolve()), "B": str(HERE.parents[1])}
    spent: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            ms = 1e3 * _run(trees[side], args.path, args.requests, args.concurrency)
            spent[side].append(ms)
            print(f"round {r + 1}, {side}: {ms:.3f} ms a request", flush=True)
    best = {side: min(v) for side, v in spent.items()}
    print(
        f"via {args.path}, {args.requests} one-token requests, {args.concurrency} at a time,"
        f" CPU a request (best of {args.rounds}): A {best['A']:.3f} ms, B {best['B']:.3f} ms,"
        f" B/A {best['B'] / best['A']:.2f}"
    )
    if args.json:
        figures = {"trees": trees, "ms_per_request": spent, "best": best}
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
