"""``mesh bench model``: the bundled GGUF through the mesh against raw llama-cpp-python.

Same model file, same prompt, same settings (context, threads, greedy decoding), rounds taking
turns: raw llama-cpp-python in this process, the edge's local path (an edge process), and the
cloud path (a worker process). Reported: time to first token and decode tokens/s (tokens after
the first over the time after the first), and each path's ratio to raw.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.models import resolve_model_path
from mesh.testing.chaos import MeshProcess, Server, wait_for_edge, wait_for_worker
from mesh_app.bench.common import bench_dir, table
from protocol.messages import EndEvent, TokenEvent

PROMPTS = (
    "Say hello to a new user.",
    "Name three fruits.",
    "Give me a short tip for sleeping well.",
)


def _raw(llama: Any, prompt: str, tokens: int) -> tuple[float, float]:
    began = time.perf_counter()
    first: float | None = None
    count = 0
    for part in llama.create_chat_completion(
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        max_tokens=tokens,
        temperature=0,
    ):
        if part["choices"][0].get("delta", {}).get("content"):
            first = first or time.perf_counter()
            count += 1
    done = time.perf_counter()
    return _rates(began, first, done, count)


def _rates(began: float, first: float | None, done: float, count: int) -> tuple[float, float]:
    first = first or done
    decode = (count - 1) / (done - first) if count > 1 and done > first else float("nan")
    return (first - began) * 1000, decode


async def _mesh(client: MeshClient, prompt: str, tokens: int, **kw: Any) -> tuple[float, float]:
    began = time.perf_counter()
    first: float | None = None
    end: EndEvent | None = None
    async for event in client.stream(prompt, max_tokens=tokens, temperature=0, **kw):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter()
        elif isinstance(event, EndEvent):
            end = event
    done = time.perf_counter()
    count = end.usage.completion_tokens if end else 0
    return _rates(began, first, done, count)


async def run(*, rounds: int = 6, tokens: int = 64, threads: int = 1) -> dict[str, Any]:
    from llama_cpp import Llama

    path = resolve_model_path(None)
    tmp = bench_dir("mesh-bench-model-")
    server = Server(tmp / "store")
    await server.start()
    common = {
        "MESH_NATS_URL": server.url,
        "MESH_LOG_LEVEL": "warning",
        "MESH_EDGE_MODEL_N_THREADS": str(threads),
        "MESH_WORKER_MODEL_N_THREADS": str(threads),
    }
    edge = MeshProcess(
        "edge",
        "bench",
        {**common, "MESH_EDGE_EDGE_ID": "bench", "MESH_EDGE_HTTP_PORT": "-1"},
        tmp / "edge.log",
    )
    worker = MeshProcess(
        "worker",
        "bench-llama",
        {**common, "MESH_WORKER_NODE_ID": "bench-llama"},
        tmp / "worker.log",
    )
    samples: dict[str, list[tuple[float, float]]] = {
        "raw llama-cpp-python": [],
        "edge local": [],
        "cloud": [],
    }
    try:
        await edge.start()
        await worker.start()
        settings = load_settings(
            {("nats", "url"): server.url, ("edge", "edge_id"): "bench"}, environ={}
        )
        async with Connection(settings.nats, "bench-probe") as conn:
            await wait_for_edge(conn, "bench", timeout=120)
            await wait_for_worker(conn, "bench-llama", timeout=120)
        llama = Llama(
            model_path=str(path),
            n_ctx=settings.edge.model.n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        async with MeshClient(settings=settings, first_event_timeout=120, idle_timeout=120) as c:

            async def run_raw(prompt: str) -> tuple[float, float]:
                return await asyncio.to_thread(_raw, llama, prompt, tokens)

            async def run_local(prompt: str) -> tuple[float, float]:
                return await _mesh(c, prompt, tokens, route="local")

            async def run_cloud(prompt: str) -> tuple[float, float]:
                return await _mesh(c, prompt, tokens, via="cloud")

            runs = {"raw llama-cpp-python": run_raw, "edge local": run_local, "cloud": run_cloud}
            for fn in runs.values():  # warm each path (and its prompt caches)
                for prompt in PROMPTS:
                    await fn(prompt)
            for r in range(rounds):
                names = list(runs)
                for name in names[r % 3 :] + names[: r % 3]:
                    samples[name].append(await runs[name](PROMPTS[r % len(PROMPTS)]))
    finally:
        await asyncio.gather(edge.stop(), worker.stop(), return_exceptions=True)
        await server.stop()
    raw = statistics.median(d for _t, d in samples["raw llama-cpp-python"])
    results: dict[str, Any] = {"model": path.name, "threads": threads, "tokens": tokens}
    for name, rows in samples.items():
        decode = statistics.median(d for _t, d in rows)
        results[name] = {
            "ttft_p50_ms": statistics.median(t for t, _d in rows),
            "decode_tokens_per_s": decode,
            "of_raw": decode / raw,
        }
    return results


def render(results: dict[str, Any]) -> str:
    rows = [
        [name, r["ttft_p50_ms"], r["decode_tokens_per_s"], f"{r['of_raw']:.1%}"]
        for name, r in results.items()
        if isinstance(r, dict)
    ]
    head = (
        f"model: {results['model']}, {results['threads']} thread(s), "
        f"{results['tokens']} tokens, greedy"
    )
    return head + "\n" + table(["path", "TTFT p50 ms", "decode tok/s", "of raw"], rows)
