"""Benchmark: time to first token and tokens/s, edge-local vs escalated, through the real mesh.

    .venv/bin/python -m benchmarks.bench_paths [--requests 20] [--max-tokens 64]

Part 1 runs the embedded local mesh (nats-server, worker and edge on the bundled SmolLM2-135M)
and asks the same prompts with route=local and route=cloud, alternating, so both paths see the
same machine load. Part 2 measures the mesh alone: a synthetic backend that yields tokens
instantly, streamed worker -> client with token coalescing off and on, to show the per-message
cost that coalescing removes and that TTFT does not pay for it.
Figures are printed; nothing is asserted (machines here are shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncGenerator

from cloud_node.worker import Worker
from mesh.backends.base import Capacity, Chunk, Health
from mesh.client import MeshClient
from mesh.config import LogSettings, MeshSettings, load_settings
from mesh.connection import Connection
from mesh.local import LocalMesh
from mesh.logs import configure_logging
from mesh.nats_server import NatsServer
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

    async def generate(self, request: InferRequest) -> AsyncGenerator[Chunk, None]:
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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--instant-tokens", type=int, default=4000)
    args = parser.parse_args()
    configure_logging(LogSettings(level="warning"))
    await model_paths(args.requests, args.max_tokens)
    await mesh_only(args.instant_tokens, max(3, args.requests // 4))


if __name__ == "__main__":
    asyncio.run(main())
