"""A node's process keeps garbage-collection pauses rare while it serves (:mod:`mesh.heap`).

A real ``mesh worker`` process, started as an operator starts it, on its own nats-server; what it
says on its metrics page about its collections.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.chaos import MeshProcess, wait_for_worker, worker_env
from tests.conftest import make_settings
from tests.helpers import eventually, scrape

REQUESTS = 300


async def _collections(port: int) -> dict[str, float]:
    """Collections so far, by generation, from the page."""
    page = await scrape(f"http://127.0.0.1:{port}/metrics")
    return {
        sample.labels["generation"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "mesh_process_gc_pause_seconds_count"
    }


async def test_a_serving_worker_collects_its_young_garbage_rarely(tmp_path: Path) -> None:
    """Every 700 allocations (the interpreter's default) a worker ran a young collection about
    every 40 requests here (7 and 8 in these 300), each standing every stream still; every
    5,000, none in 300."""
    async with NatsServer(port=-1, store_dir=str(tmp_path / "store")) as server:
        env = {
            **worker_env(server.url, "gc-w", slots=8, token_ms=0),
            "MESH_WORKER_MODEL_PREFILL_DELAY_MS": "0",
            "MESH_WORKER_METRICS_PORT": "0",
            "MESH_LOG_LEVEL": "warning",
        }
        worker = await MeshProcess("worker", "gc-w", env, tmp_path / "worker.log").start()
        try:
            settings = make_settings(server.url)
            async with Connection(settings.nats, "probe") as conn:
                await wait_for_worker(conn, "gc-w", process=worker)
            found: list[int] = []

            async def port_printed() -> bool:
                text = worker.log_path.read_text(errors="replace")
                found[:] = [int(p) for p in re.findall(r"metrics on port (\d+)", text)]
                return bool(found)

            await eventually(port_printed, what="the worker's metrics port")
            async with MeshClient(settings=settings) as client:
                gate = asyncio.Semaphore(8)

                async def ask(i: int) -> None:
                    async with gate:
                        answer = await client.complete(f"q{i}", via="cloud", max_tokens=2)
                        assert answer.end.usage.completion_tokens == 2, answer

                await asyncio.gather(*(ask(-i) for i in range(1, 21)))  # warm
                before = await _collections(found[0])
                await asyncio.gather(*(ask(i) for i in range(REQUESTS)))
                after = await _collections(found[0])
            young = after["0"] - before["0"]
            assert young <= REQUESTS / 100, (young, before, after)
        finally:
            await worker.stop()
