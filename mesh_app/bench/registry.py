"""``mesh bench registry``: what the node registry's fan-out costs the server.

Every worker's heartbeat (a KV put on ``mesh_nodes``) is delivered to every edge watching the
registry: W x E deliveries a second. This puts ``puts`` heartbeat-sized entries (100 keys, like
100 workers) while ``watchers`` connections watch the bucket as edges do, and reports the
nats-server's CPU per delivery (the put's share included).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import api

from mesh.nats_server import NatsServer
from mesh.registry import NodeInfo
from mesh_app.bench.common import cpu_seconds
from protocol.subjects import NODES_BUCKET


async def run(*, puts: int = 20_000, watchers: int = 10) -> dict[str, Any]:
    async with NatsServer() as server:
        assert server.pid is not None
        conns = [await nats.connect(server.url) for _ in range(watchers + 1)]
        try:
            kv = (
                await conns[0]
                .jetstream()
                .create_key_value(
                    api.KeyValueConfig(
                        bucket=NODES_BUCKET, history=1, ttl=3, storage=api.StorageType.FILE
                    )
                )
            )
            got = [0] * watchers
            all_seen = asyncio.Event()

            async def follow(i: int, nc: Client) -> None:
                watch = await (await nc.jetstream().key_value(NODES_BUCKET)).watchall()
                async for entry in watch:
                    if entry is not None:
                        got[i] += 1
                        if min(got) >= puts:
                            all_seen.set()

            tasks = [asyncio.create_task(follow(i, nc)) for i, nc in enumerate(conns[1:])]
            await asyncio.sleep(0.5)
            info = NodeInfo(node_id="worker-x", role="worker", models=["smollm2"], slots=4, free=3)
            payload = info.model_dump_json().encode()
            cpu0, began = cpu_seconds(server.pid), time.perf_counter()
            for j in range(puts):
                await kv.put(f"worker.w{j % 100}", payload)
            await asyncio.wait_for(all_seen.wait(), 300)
            wall, cpu = time.perf_counter() - began, cpu_seconds(server.pid) - cpu0
            for task in tasks:
                task.cancel()
        finally:
            for nc in conns:
                await nc.close()
    deliveries = puts * watchers
    return {
        "puts": puts,
        "watchers": watchers,
        "deliveries": deliveries,
        "wall_s": wall,
        "server_cpu_s": cpu,
        "server_cpu_per_delivery_us": cpu / deliveries * 1e6,
    }


def render(results: dict[str, Any]) -> str:
    r = results
    return (
        f"registry: {r['puts']} puts x {r['watchers']} watchers = {r['deliveries']} deliveries "
        f"in {r['wall_s']:.2f} s; nats-server CPU {r['server_cpu_s']:.2f} s = "
        f"{r['server_cpu_per_delivery_us']:.1f} us per delivery"
    )
