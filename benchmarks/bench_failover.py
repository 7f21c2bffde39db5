"""Benchmark: how long a client waits when the worker generating its answer is killed.

    .venv/bin/python -m benchmarks.bench_failover [--rounds 10] [--requests 4]

Each round starts a worker process, sends requests (SDK straight to the queue, and through an
edge), kills the worker with SIGKILL mid-answer, and lets another worker process continue the
answers. For every answer it records the time from the kill to the first token of the
continued attempt, and checks the answer exactly (deterministic backend). Prints p50/p99 over
all rounds and the count of answers that were not correct (expected: 0).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from mesh.client import MeshClient
from mesh.config import LogSettings, load_settings
from mesh.connection import Connection
from mesh.logs import configure_logging
from mesh.testing.chaos import (
    MeshProcess,
    Server,
    Tally,
    ask,
    edge_env,
    wait_for_edge,
    wait_for_worker,
    worker_env,
)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=4, help="answers in flight per kill")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per answer (20 ms each)")
    args = parser.parse_args()
    configure_logging(LogSettings(level="warning"))
    tmp = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    server = Server(tmp / "store")
    await server.start()
    settings = load_settings(
        {("nats", "url"): server.url, ("edge", "edge_id"): "bench"}, environ={}
    )
    processes: list[MeshProcess] = []
    tally = Tally()
    waits: list[float] = []
    try:
        async with (
            Connection(settings.nats, "bench") as conn,
            MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as client,
        ):
            edge = MeshProcess("edge", "bench", edge_env(server.url, "bench"), tmp / "edge.log")
            processes.append(await edge.start())
            await wait_for_edge(conn, "bench")
            for round_no in range(args.rounds):
                name = f"doomed{round_no}"
                doomed = MeshProcess(
                    "worker", name, worker_env(server.url, name, slots=16), tmp / f"{name}.log"
                )
                processes.append(await doomed.start())
                await wait_for_worker(conn, name)
                half = args.requests // 2
                asks = [
                    ask(client, f"r{round_no}c{i}", args.tokens, via="cloud")
                    for i in range(args.requests - half)
                ]
                asks += [
                    ask(client, f"r{round_no}e{i}", args.tokens, via="edge", route="cloud")
                    for i in range(half)
                ]
                pending = [asyncio.ensure_future(a) for a in asks]
                survivor_name = f"survivor{round_no}"
                survivor = MeshProcess(
                    "worker",
                    survivor_name,
                    worker_env(server.url, survivor_name, slots=16),
                    tmp / f"{survivor_name}.log",
                )
                processes.append(await survivor.start())
                await wait_for_worker(conn, survivor_name)
                killed = time.monotonic()
                doomed.kill()
                for outcome in await asyncio.gather(*pending):
                    tally.add(outcome)
                    if outcome.first_continued is not None:
                        waits.append(outcome.first_continued - killed)
                await survivor.stop()
                latest = tally.outcomes[-len(asks) :]
                continued = sum(1 for o in latest if o.first_continued is not None)
                print(
                    f"round {round_no + 1}: continued {continued}/{len(asks)}, "
                    f"{dict(tally.counts())}",
                    flush=True,
                )
    finally:
        await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)
        await server.stop()
    counts = tally.counts()
    print(f"\nanswers: {len(tally.outcomes)}, {dict(counts)}")
    if waits:
        print(
            f"kill -9 to first continued token at the client: n={len(waits)} "
            f"p50 {pct(waits, 0.5):.2f} s, p99 {pct(waits, 0.99):.2f} s, "
            f"min {min(waits):.2f} s, max {max(waits):.2f} s"
        )
    print(
        f"ack_wait {settings.stream.ack_wait:g} s, progress every "
        f"{settings.stream.ack_wait * settings.worker.progress_fraction:g} s"
    )


if __name__ == "__main__":
    asyncio.run(main())
