"""Benchmark: time to first token and tokens/s, edge-local vs escalated, through the real mesh.

    .venv/bin/python -m benchmarks.bench_paths [--requests 20] [--max-tokens 64]

Part 1 runs the embedded local mesh (nats-server, worker and edge on the bundled SmolLM2-135M)
and asks the same prompts with route=local and route=cloud, alternating, so both paths see the
same machine load. Part 2 measures the mesh alone: a synthetic backend that yields tokens
instantly, streamed worker -> client with token coalescing off and on, to show the per-message
cost that coalescing removes and that TTFT does not pay for it. Part 3 measures what the answer
store and repair cost: two meshes side by side, one keeping events in MESH_TOK (file) and one
with the store off, asked in alternation: TTFT (via the cloud and via an edge) and relay
throughput.
Figures are printed; nothing is asserted (machines here are shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncGenerator

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.base import Capacity, Chunk, Health
from mesh.client import MeshClient
from mesh.config import LogSettings, MeshSettings, load_settings
from mesh.connection import Connection
from mesh.logs import configure_logging
from mesh.nats_server import NatsServer
from mesh_app.local import LocalMesh
from protocol.messages import EndEvent, InferRequest, TokenEvent, Usage

PROMPTS = [
    "Say hello to a new user.",
    "What is the capital of France?",
    "Name three fruits.",
    "Give me a short tip for sleeping well.",
    "What colour is the sky on a clear day?",
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def timed(client: MeshClient, prompt: str, **kwargs: object) -> dict[str, float]:
    start = time.perf_counter()
    first: float | None = None
    messages = 0
    end: EndEvent | None = None
    async for event in client.stream(prompt, **kwargs):  # type: ignore[arg-type]
        if isinstance(event, TokenEvent):
            messages += 1
            first = first or time.perf_counter()
        elif isinstance(event, EndEvent):
            end = event
    done = time.perf_counter()
    assert end is not None
    assert first is not None
    tokens = end.usage.completion_tokens
    return {
        "ttft_ms": (first - start) * 1000,
        "total_ms": (done - start) * 1000,
        "tokens": tokens,
        "messages": messages,
        "tok_s": (tokens - 1) / (done - first) if done > first and tokens > 1 else 0.0,
    }


def summary(name: str, rows: list[dict[str, float]]) -> str:
    ttft = [r["ttft_ms"] for r in rows]
    return (
        f"{name:<26} n={len(rows):<3} TTFT p50 {pct(ttft, 0.5):7.1f} ms"
        f"  p95 {pct(ttft, 0.95):7.1f} ms"
        f"  | {statistics.median(r['tok_s'] for r in rows):7.1f} tok/s"
        f"  | {statistics.median(r['tokens'] / max(1, r['messages']) for r in rows):5.1f} tok/msg"
        f"  | total p50 {pct([r['total_ms'] for r in rows], 0.5):7.1f} ms"
    )


async def model_paths(requests: int, max_tokens: int) -> None:
    settings = load_settings({("nats", "local_port"): -1, ("log", "level"): "warning"})
    async with LocalMesh(settings) as mesh, MeshClient(settings=mesh.settings) as client:
        for route in ("local", "cloud"):  # warm both models and caches
            await timed(client, "warm up", route=route, max_tokens=8, temperature=0)
        rows: dict[str, list[dict[str, float]]] = {"local": [], "cloud": []}
        for i in range(requests):
            for route in ("local", "cloud") if i % 2 == 0 else ("cloud", "local"):
                prompt = PROMPTS[i % len(PROMPTS)]
                rows[route].append(
                    await timed(client, prompt, route=route, max_tokens=max_tokens, temperature=0)
                )
    print("\n== Part 1: SmolLM2-135M Q4_1 through the local mesh (SDK -> edge -> ...)")
    print(summary("edge-local (llama.cpp)", rows["local"]))
    print(summary("escalated (JetStream)", rows["cloud"]))
    lt = pct([r["ttft_ms"] for r in rows["local"]], 0.5)
    ct = pct([r["ttft_ms"] for r in rows["cloud"]], 0.5)
    print(f"escalation adds {ct - lt:.1f} ms to TTFT p50 (ratio cloud/local {ct / lt:.2f})")


class InstantBackend:
    """Yields ``n`` one-token chunks as fast as the event loop allows (mesh-only benchmark)."""

    model = "instant"
    continues = False

    def __init__(self, slots: int = 4) -> None:
        self.slots = slots

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def capacity(self) -> Capacity:
        return Capacity(total=self.slots, free=self.slots)

    async def health(self) -> Health:
        return Health(ok=True)

    async def abort(self, request_id: str) -> None:
        return None

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        for i in range(request.max_tokens):
            if i % 64 == 0:
                await asyncio.sleep(0)
            yield Chunk(text="tok ")
        yield Chunk(finish_reason="length", usage=Usage(completion_tokens=request.max_tokens))


async def mesh_only(tokens: int, requests: int) -> None:
    print(f"\n== Part 2: mesh only, instant backend, {tokens} tokens/request (worker -> client)")
    async with NatsServer() as server:
        for label, parts, linger_ms in (
            ("coalescing off (1/msg)", 1, 0.0),
            ("coalescing on (16, 5 ms)", 16, 5.0),
        ):
            settings: MeshSettings = load_settings({("nats", "url"): server.url}, environ={})
            settings.worker.coalesce_tokens = parts
            settings.worker.coalesce_ms = linger_ms
            settings.edge.cloud_model = "instant"
            async with Connection(settings.nats, "bench") as conn:
                async with (
                    Worker(settings, conn, InstantBackend()),
                    MeshClient(settings=settings) as c,
                ):
                    await timed(c, "warm", via="cloud", max_tokens=32)
                    rows = [
                        await timed(c, "x", via="cloud", max_tokens=tokens) for _ in range(requests)
                    ]
                await conn.jsm().delete_stream(settings.stream.name)
            print(summary(label, rows))


async def throughput(client: MeshClient, streams: int, tokens: int) -> float:
    """Tokens per second delivered to ``streams`` concurrent via-cloud clients."""
    began = time.perf_counter()
    rows = await asyncio.gather(
        *(timed(client, "x", via="cloud", max_tokens=tokens) for _ in range(streams))
    )
    return sum(r["tokens"] for r in rows) / (time.perf_counter() - began)


async def repair_cost(requests: int, tokens: int, rounds: int) -> None:
    print("\n== Part 3: what the answer store costs (store file vs off, alternating)")
    configs = {"store file": "file", "store off": "off"}
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, MeshClient] = {}
        for label, storage in configs.items():
            server = await stack.enter_async_context(NatsServer())
            settings = load_settings({("nats", "url"): server.url}, environ={})
            settings.stream.answer_storage = storage  # type: ignore[assignment]
            settings.edge.cloud_model = "instant"
            settings.edge.http_port = -1
            conn = await stack.enter_async_context(Connection(settings.nats, "bench"))
            await stack.enter_async_context(Worker(settings, conn, InstantBackend(slots=8)))
            await stack.enter_async_context(
                EdgeNode(settings, conn, InstantBackend(), HeuristicRouter())  # type: ignore[arg-type]
            )
            clients[label] = await stack.enter_async_context(MeshClient(settings=settings))
            for _ in range(5):
                await timed(clients[label], "warm", via="cloud", max_tokens=16)
                await timed(clients[label], "warm", route="cloud", max_tokens=16)
        ttft: dict[str, dict[str, list[dict[str, float]]]] = {
            label: {"cloud": [], "edge": []} for label in configs
        }
        for i in range(requests):
            for label in configs if i % 2 == 0 else reversed(list(configs)):
                client = clients[label]
                ttft[label]["cloud"].append(await timed(client, "x", via="cloud", max_tokens=16))
                ttft[label]["edge"].append(await timed(client, "x", route="cloud", max_tokens=16))
        rates: dict[str, list[float]] = {label: [] for label in configs}
        for r in range(rounds):
            for label in configs if r % 2 == 0 else reversed(list(configs)):
                rates[label].append(await throughput(clients[label], 4, tokens))
    for label in configs:
        for path in ("cloud", "edge"):
            print(summary(f"{label}, via {path}", ttft[label][path]))
    for path in ("cloud", "edge"):
        on = pct([r["ttft_ms"] for r in ttft["store file"][path]], 0.5)
        off = pct([r["ttft_ms"] for r in ttft["store off"][path]], 0.5)
        print(f"TTFT p50 via {path}: store file {on:.2f} ms, off {off:.2f} ms: {on - off:+.2f} ms")
    on, off = statistics.median(rates["store file"]), statistics.median(rates["store off"])
    print(
        f"relay, 4 streams x {tokens} tokens (median of {rounds}): store file {on:,.0f} tok/s, "
        f"off {off:,.0f} tok/s: {on / off:.1%} of it"
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--instant-tokens", type=int, default=4000)
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    parser.add_argument("--rounds", type=int, default=6, help="throughput rounds in part 3")
    args = parser.parse_args()
    configure_logging(LogSettings(level="warning"))
    parts = {int(p) for p in args.parts.split(",")}
    if 1 in parts:
        await model_paths(args.requests, args.max_tokens)
    if 2 in parts:
        await mesh_only(args.instant_tokens, max(3, args.requests // 4))
    if 3 in parts:
        await repair_cost(max(args.requests, 40), args.instant_tokens, args.rounds)


if __name__ == "__main__":
    asyncio.run(main())
