"""``mesh bench paths``: what the mesh adds over calling the engine's HTTP API directly.

Three ways to the same deterministic OpenAI-compatible server (``mesh.testing.openai_server``,
a benchmark backend, not a model: 50 ms prefill, 50 tokens/s per stream by default):

- direct: HTTP SSE straight to the server, what a vLLM user would do instead;
- via cloud: SDK -> JetStream -> worker -> token subject -> SDK;
- via edge: SDK -> edge -> JetStream -> worker -> edge -> SDK (route=cloud).

At each concurrency the three paths take turns, round after round, so they see the same load.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from mesh.client import MeshClient
from mesh_app.bench.common import Timed, bench_mesh, pct, table, timed_stream

PATHS = ("direct", "via cloud", "via edge")


async def direct(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> Timed:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "stream": True,
    }
    began = time.perf_counter()
    first: float | None = None
    got = 0
    async with session.post(f"{url}/chat/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    got += 1
    done = time.perf_counter()
    return Timed(ttft=(first or done) - began, total=done - began, tokens=got)


async def run(
    *,
    concurrency: tuple[int, ...] = (1, 32),
    rounds: int = 10,
    tokens: int = 32,
    prefill_ms: float = 50.0,
    token_ms: float = 20.0,
) -> dict[str, Any]:
    results: dict[str, Any] = {"backend": {"prefill_ms": prefill_ms, "token_ms": token_ms}}
    async with (
        bench_mesh(prefill_ms=prefill_ms, token_ms=token_ms, slots=max(concurrency)) as mesh,
        MeshClient(settings=mesh.settings, first_event_timeout=60, idle_timeout=60) as client,
        aiohttp.ClientSession() as session,
    ):
        prompt = "[tag:b] benchmark"

        async def one(path: str) -> Timed:
            if path == "direct":
                return await direct(session, mesh.backend_url, prompt, tokens)
            if path == "via cloud":
                return await timed_stream(client, prompt, via="cloud", max_tokens=tokens)
            return await timed_stream(client, prompt, route="cloud", max_tokens=tokens)

        for path in PATHS:  # warm connections, consumers and caches
            for _ in range(3):
                await one(path)
        for streams in concurrency:
            samples: dict[str, list[Timed]] = {p: [] for p in PATHS}
            for r in range(rounds):
                order = PATHS[r % 3 :] + PATHS[: r % 3]
                for path in order:
                    samples[path] += await asyncio.gather(*(one(path) for _ in range(streams)))
            results[str(streams)] = _summarize(samples, tokens)
    return results


def _summarize(samples: dict[str, list[Timed]], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = samples["direct"]
    for path, rows in samples.items():
        ttft = [r.ttft * 1000 for r in rows]
        total = [r.total * 1000 for r in rows]
        out[path] = {
            "n": len(rows),
            "ttft_p50_ms": pct(ttft, 0.5),
            "ttft_p99_ms": pct(ttft, 0.99),
            "total_p50_ms": pct(total, 0.5),
            "complete": sum(1 for r in rows if r.tokens == tokens),
        }
    for path in PATHS[1:]:
        out[path]["added_ttft_p50_ms"] = out[path]["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"]
        out[path]["added_ttft_p99_ms"] = out[path]["ttft_p99_ms"] - out["direct"]["ttft_p99_ms"]
        out[path]["added_total_p50_ms"] = out[path]["total_p50_ms"] - out["direct"]["total_p50_ms"]
    out["direct"]["n_base"] = len(base)
    return out


def render(results: dict[str, Any]) -> str:
    rows = []
    for streams, by_path in results.items():
        if streams == "backend":
            continue
        for path in PATHS:
            r = by_path[path]
            rows.append(
                [
                    streams,
                    path,
                    r["n"],
                    r["ttft_p50_ms"],
                    r["ttft_p99_ms"],
                    r.get("added_ttft_p50_ms", 0.0),
                    r.get("added_ttft_p99_ms", 0.0),
                    r["total_p50_ms"],
                    r["complete"],
                ]
            )
    b = results["backend"]
    head = (
        f"paths: deterministic backend, {b['prefill_ms']:g} ms prefill, "
        f"{1000 / b['token_ms']:g} tokens/s per stream; milliseconds"
    )
    return (
        head
        + "\n"
        + table(
            [
                "streams",
                "path",
                "n",
                "TTFT p50",
                "TTFT p99",
                "+p50",
                "+p99",
                "total p50",
                "complete",
            ],
            rows,
        )
    )
