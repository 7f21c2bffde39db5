"""``mesh bench fleet``: many worker processes, concurrency pushed up, on one server and on a
3-node cluster with R3 streams, in the same run.

Workers run the deterministic engine in process (``token_ms`` per token, ``prefill_ms`` before
the first), so the engine is never the limit: a stream costs the engine nothing but a sleep.
Clients are this process, over several connections, streaming straight from the queue. For each
topology and concurrency: requests/s, tokens/s, TTFT p50/p99, and each process's share of a
CPU core over the step, which names what was saturated (on a machine with few cores, whoever
reaches ~100% of a core, or all of them together, is the limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.testing.chaos import JsCluster, MeshProcess, Server, wait_for_worker, worker_env
from mesh_app.bench.common import Timed, bench_dir, cpu_seconds, pct, table, timed_stream

WORKERS = 4
SLOTS = 128
"""Per worker: as many as the offered concurrency at most, so the engine's slots never hold
requests back: what limits the fleet is the mesh (or this machine's cores)."""
CONCURRENCY = (16, 64, 256, 512)
DURATION_S = 3.0
"""Each step: ``concurrency`` clients each sending one request after another for this long."""
TOKENS = 40
TOKEN_MS = 25.0
PREFILL_MS = 20.0
CLIENTS = 4
TOPOLOGIES = ("one server", "cluster", "cluster, MESH_TOK R1")
"""One nats-server; 3 with every stream R3; 3 with the answer store alone R1."""


@contextlib.asynccontextmanager
async def _fleet(
    topology: str, tmp: Path, workers: int
) -> AsyncIterator[tuple[MeshSettings, dict[str, int]]]:
    """The servers and ``WORKERS`` worker processes; yields settings and {process: pid}."""
    cluster: JsCluster | None = None
    server: Server | None = None
    extra: dict[str, str] = {}
    if topology.startswith("cluster"):
        cluster = JsCluster(tmp / "cluster")
        (tmp / "cluster").mkdir()
        await cluster.start()
        url = cluster.url
        extra = {"MESH_STREAM_REPLICAS": "3"}
        if "R1" in topology:
            extra["MESH_STREAM_ANSWER_REPLICAS"] = "1"
    else:
        server = Server(tmp / "store")
        await server.start()
        url = server.url
    settings = load_settings(
        {("nats", "url"): url, ("stream", "replicas"): 3 if cluster else 1}, environ={}
    )
    procs: list[MeshProcess] = []
    try:
        async with Connection(settings.nats, "bench-fleet") as conn:
            await _js_ready(conn)
            for i in range(workers):
                env = {
                    **worker_env(url, f"fleet-{i}", slots=SLOTS, token_ms=TOKEN_MS),
                    "MESH_WORKER_MODEL_PREFILL_DELAY_MS": str(PREFILL_MS),
                    "MESH_LOG_LEVEL": "warning",
                    **extra,
                }
                procs.append(
                    await MeshProcess("worker", f"fleet-{i}", env, tmp / f"w{i}.log").start()
                )
                await wait_for_worker(conn, f"fleet-{i}", timeout=60)
        pids = {f"worker {i}": p.pid for i, p in enumerate(procs)}
        if cluster is not None:
            pids.update({f"nats {n}": s.pid for n, s in cluster.servers.items() if s.pid})
        elif server is not None and server.pid:
            pids["nats"] = server.pid
        yield settings, pids
    finally:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        if cluster is not None:
            await cluster.stop()
        if server is not None:
            await server.stop()


async def _js_ready(conn: Connection, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            await conn.jsm().account_info()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _step(
    clients: list[MeshClient], concurrency: int, pids: dict[str, int], duration: float
) -> dict[str, Any]:
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    mine_before = cpu_seconds()
    began = time.perf_counter()
    stop_at = began + duration

    async def user(i: int) -> list[Timed | BaseException]:
        """A closed loop: the next request when the last one ended, until the step's end."""
        out: list[Timed | BaseException] = []
        n = 0
        while time.perf_counter() < stop_at:
            try:
                out.append(
                    await timed_stream(
                        clients[i % len(clients)],
                        f"[tag:f{concurrency}x{i}n{n}] go",
                        via="cloud",
                        max_tokens=TOKENS,
                    )
                )
            except Exception as exc:
                out.append(exc)
            n += 1
        return out

    per_user = await asyncio.gather(*(user(i) for i in range(concurrency)))
    wall = time.perf_counter() - began
    results = [r for rs in per_user for r in rs]
    done = [r for r in results if isinstance(r, Timed)]
    ttfts = [r.ttft * 1000 for r in done]
    cpu = {name: (cpu_seconds(pid) - cpu_before[name]) / wall for name, pid in pids.items()}
    cpu["bench clients"] = (cpu_seconds() - mine_before) / wall
    busiest = max(cpu, key=lambda name: cpu[name])
    return {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "requests_per_s": len(done) / wall,
        "tokens_per_s": sum(r.tokens for r in done) / wall,
        "ttft_p50_ms": pct(ttfts, 0.5),
        "ttft_p99_ms": pct(ttfts, 0.99),
        "cpu_share": cpu,
        "busiest": busiest,
        "all_cpu": sum(cpu.values()),
    }


async def run(
    *,
    workers: int = WORKERS,
    concurrency: tuple[int, ...] = CONCURRENCY,
    duration: float = DURATION_S,
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "workers": workers,
        "duration_s": duration,
        "slots_per_worker": SLOTS,
        "tokens": TOKENS,
        "token_ms": TOKEN_MS,
        "prefill_ms": PREFILL_MS,
    }
    for topology in TOPOLOGIES:
        tmp = bench_dir("mesh-bench-fleet-")
        async with _fleet(topology, tmp, workers) as (
            settings,
            pids,
        ):
            clients = [
                MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60)
                for _ in range(CLIENTS)
            ]
            for client in clients:
                await client.connect()
            try:
                await _step(clients, 4, pids, 0.1)  # warm-up: connections, consumers, caches
                results[topology] = [await _step(clients, c, pids, duration) for c in concurrency]
            finally:
                for client in clients:
                    await client.close()
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for topology in TOPOLOGIES:
        for step in results.get(topology, []):
            cpu = step["cpu_share"]
            rows.append(
                [
                    topology,
                    step["concurrency"],
                    f"{step['completed']}/{step['completed'] + step['failed']}",
                    f"{step['requests_per_s']:.1f}",
                    f"{step['tokens_per_s']:.0f}",
                    f"{step['ttft_p50_ms']:.1f}",
                    f"{step['ttft_p99_ms']:.1f}",
                    f"{step['busiest']} {cpu[step['busiest']] * 100:.0f}%",
                    f"{step['all_cpu'] * 100:.0f}%",
                ]
            )
    head = (
        f"fleet: {results['workers']} worker processes (deterministic engine, "
        f"{1000 / results['token_ms']:g} tokens/s per stream, {results['tokens']} tokens), "
        "clients in this process; one server vs a 3-node cluster with R3 streams (and with the "
        "answer store MESH_TOK alone at R1)"
    )
    return (
        head
        + "\n"
        + table(
            [
                "hub",
                "streams",
                "done",
                "req/s",
                "tok/s",
                "TTFT p50",
                "TTFT p99",
                "busiest process (of a core)",
                "all processes",
            ],
            rows,
        )
    )
