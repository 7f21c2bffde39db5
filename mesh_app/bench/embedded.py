"""``mesh bench embedded``: the mesh in this one process: edge-local vs escalated, coalescing,
and what the answer store costs.

    mesh bench embedded [--requests 20] [--max-tokens 64] [--instant-tokens 4000]
        [--sections model,coalescing,store] [--rounds 6] [--json FILE]

Not part of ``mesh bench all`` (the bundled model on both paths takes a while); it was
``python -m benchmarks.bench_paths`` (sections 1, 2 and 3 there).

- ``model``: the embedded local mesh (nats-server, worker and edge on the bundled
  SmolLM2-135M) asked the same prompts with route=local and route=cloud, alternating, so both
  paths see the same machine load: time to first token and tokens/s, edge-local vs escalated.
- ``coalescing``: the mesh alone: a synthetic backend that yields tokens instantly, streamed
  worker -> client with token coalescing off and on, to show the per-message cost that
  coalescing removes and that TTFT does not pay for it.
- ``store``: what the answer store and repair cost: two meshes side by side, one keeping
  events in MESH_TOK (file) and one with the store off, asked in alternation: TTFT (via the
  cloud and via an edge) and relay throughput.

Unlike the other parts, worker and edge run in this process (no process hops of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncGenerator
from typing import Any

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.base import Capacity, Chunk, Health
from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh_app.bench.common import pct
from mesh_app.local import LocalMesh
from protocol.messages import EndEvent, InferRequest, TokenEvent, Usage

SECTIONS = ("model", "coalescing", "store")
PROMPTS = [
    "Say hello to a new user.",
    "What is the capital of France?",
    "Name three fruits.",
    "Give me a short tip for sleeping well.",
    "What colour is the sky on a clear day?",
]
STORES = {"store file": "file", "store off": "off"}


async def timed(client: MeshClient, prompt: str, **kwargs: Any) -> dict[str, float]:
    start = time.perf_counter()
    first: float | None = None
    messages = 0
    end: EndEvent | None = None
    async for event in client.stream(prompt, **kwargs):
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


def stats(rows: list[dict[str, float]]) -> dict[str, float]:
    ttft = [r["ttft_ms"] for r in rows]
    return {
        "n": len(rows),
        "ttft_p50_ms": pct(ttft, 0.5),
        "ttft_p95_ms": pct(ttft, 0.95),
        "tok_s_p50": statistics.median(r["tok_s"] for r in rows),
        "tok_per_msg_p50": statistics.median(r["tokens"] / max(1, r["messages"]) for r in rows),
        "total_p50_ms": pct([r["total_ms"] for r in rows], 0.5),
    }


def summary(name: str, s: dict[str, float]) -> str:
    return (
        f"{name:<26} n={s['n']:<3} TTFT p50 {s['ttft_p50_ms']:7.1f} ms"
        f"  p95 {s['ttft_p95_ms']:7.1f} ms"
        f"  | {s['tok_s_p50']:7.1f} tok/s"
        f"  | {s['tok_per_msg_p50']:5.1f} tok/msg"
        f"  | total p50 {s['total_p50_ms']:7.1f} ms"
    )


async def model_paths(requests: int, max_tokens: int) -> dict[str, Any]:
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
    return {route: stats(r) for route, r in rows.items()}


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


async def coalescing(tokens: int, requests: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": tokens}
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
            out[label] = stats(rows)
    return out


async def throughput(client: MeshClient, streams: int, tokens: int) -> float:
    """Tokens per second delivered to ``streams`` concurrent via-cloud clients."""
    began = time.perf_counter()
    rows = await asyncio.gather(
        *(timed(client, "x", via="cloud", max_tokens=tokens) for _ in range(streams))
    )
    return sum(r["tokens"] for r in rows) / (time.perf_counter() - began)


async def store_cost(requests: int, tokens: int, rounds: int) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, MeshClient] = {}
        for label, storage in STORES.items():
            server = await stack.enter_async_context(NatsServer())
            settings = load_settings({("nats", "url"): server.url}, environ={})
            settings.stream.answer_storage = storage  # type: ignore[assignment]
            settings.edge.cloud_model = "instant"
            settings.edge.http_port = -1
            conn = await stack.enter_async_context(Connection(settings.nats, "bench"))
            await stack.enter_async_context(Worker(settings, conn, InstantBackend(slots=8)))
            await stack.enter_async_context(
                EdgeNode(settings, conn, InstantBackend(), HeuristicRouter())
            )
            clients[label] = await stack.enter_async_context(MeshClient(settings=settings))
            for _ in range(5):
                await timed(clients[label], "warm", via="cloud", max_tokens=16)
                await timed(clients[label], "warm", route="cloud", max_tokens=16)
        ttft: dict[str, dict[str, list[dict[str, float]]]] = {
            label: {"cloud": [], "edge": []} for label in STORES
        }
        for i in range(requests):
            for label in STORES if i % 2 == 0 else reversed(list(STORES)):
                client = clients[label]
                ttft[label]["cloud"].append(await timed(client, "x", via="cloud", max_tokens=16))
                ttft[label]["edge"].append(await timed(client, "x", route="cloud", max_tokens=16))
        rates: dict[str, list[float]] = {label: [] for label in STORES}
        for r in range(rounds):
            for label in STORES if r % 2 == 0 else reversed(list(STORES)):
                rates[label].append(await throughput(clients[label], 4, tokens))
    return {
        "tokens": tokens,
        "rounds": rounds,
        "ttft": {
            label: {path: stats(rows) for path, rows in by.items()} for label, by in ttft.items()
        },
        "relay_tok_s": {label: statistics.median(rates[label]) for label in STORES},
    }


async def run(
    *,
    requests: int = 20,
    max_tokens: int = 64,
    instant_tokens: int = 4000,
    sections: tuple[str, ...] = SECTIONS,
    rounds: int = 6,
) -> dict[str, Any]:
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}: pick from {', '.join(SECTIONS)}")
    results: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens}
    if "model" in sections:
        results["model"] = await model_paths(requests, max_tokens)
    if "coalescing" in sections:
        results["coalescing"] = await coalescing(instant_tokens, max(3, requests // 4))
    if "store" in sections:
        results["store"] = await store_cost(max(requests, 40), instant_tokens, rounds)
    return results


def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    if "model" in results:
        local, cloud = results["model"]["local"], results["model"]["cloud"]
        lt, ct = local["ttft_p50_ms"], cloud["ttft_p50_ms"]
        lines += [
            "embedded, model: SmolLM2-135M Q4_1 through the local mesh (SDK -> edge -> ...)",
            summary("edge-local (llama.cpp)", local),
            summary("escalated (JetStream)", cloud),
            f"escalation adds {ct - lt:.1f} ms to TTFT p50 (ratio cloud/local {ct / lt:.2f})",
        ]
    if "coalescing" in results:
        c = results["coalescing"]
        if lines:
            lines.append("")
        lines.append(
            f"embedded, coalescing: mesh only, instant backend, {c['tokens']} tokens/request "
            "(worker -> client)"
        )
        lines += [summary(label, s) for label, s in c.items() if label != "tokens"]
    if "store" in results:
        s = results["store"]
        if lines:
            lines.append("")
        lines.append(
            "embedded, store: what the answer store costs (store file vs off, alternating)"
        )
        for label in STORES:
            for path in ("cloud", "edge"):
                lines.append(summary(f"{label}, via {path}", s["ttft"][label][path]))
        for path in ("cloud", "edge"):
            on = s["ttft"]["store file"][path]["ttft_p50_ms"]
            off = s["ttft"]["store off"][path]["ttft_p50_ms"]
            lines.append(
                f"TTFT p50 via {path}: store file {on:.2f} ms, off {off:.2f} ms: {on - off:+.2f} ms"
            )
        on, off = s["relay_tok_s"]["store file"], s["relay_tok_s"]["store off"]
        lines.append(
            f"relay, 4 streams x {s['tokens']} tokens (median of {s['rounds']}): store file "
            f"{on:,.0f} tok/s, off {off:,.0f} tok/s: {on / off:.1%} of it"
        )
    return "\n".join(lines)
