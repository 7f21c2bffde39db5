"""``mesh bench vllm``: the vLLM engine called in process against the same engine behind the
mesh (SDK -> JetStream -> a worker process on the vLLM backend -> token subject -> SDK). Needs a
CUDA GPU and vLLM; it is not part of ``all``.

Both engines run side by side on the one GPU (each with a share of its memory), load the same
model (the bundled SmolLM2-135M, converted once to a Hugging Face directory, or
``MESH_BENCH_VLLM_MODEL``) and take turns, so they see the same machine. Greedy decoding: both
paths generate the same tokens. Reported per path and concurrency: time to first token p50/p99,
time to the end p50, and tokens/s over the batch; and what the mesh adds over the direct call.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from mesh.backends.vllm import VLLMBackend
from mesh.client import MeshClient
from mesh.config import ModelSettings, load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, Server, wait_for_worker
from mesh.testing.hf_model import hf_from_gguf
from mesh_app.bench.common import Timed, bench_dir, pct, table, timed_stream
from protocol.messages import InferRequest

TOPICS = (
    "the ocean",
    "a bicycle",
    "coffee",
    "the moon",
    "libraries",
    "rain",
    "chess",
    "bread",
)
PROMPTS = tuple(
    f"{verb} {topic}."
    for verb in ("Write two sentences about", "Give three facts about", "Explain", "Describe")
    for topic in TOPICS
)


async def _direct(backend: VLLMBackend, prompt: str, tokens: int) -> Timed:
    began = time.perf_counter()
    first: float | None = None
    count = 0
    async for chunk in backend.generate(
        InferRequest(prompt=prompt, max_tokens=tokens, temperature=0)
    ):
        if chunk.text:
            first = first or time.perf_counter()
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    done = time.perf_counter()
    return Timed(ttft=(first or done) - began, total=done - began, tokens=count)


def model_settings(path: Path, share: float, slots: int) -> ModelSettings:
    return ModelSettings(
        backend="vllm", path=str(path), slots=slots, n_ctx=2048, gpu_memory_utilization=share
    )


def worker_env(server_url: str, path: Path, share: float, slots: int) -> dict[str, str]:
    """A ``mesh worker`` on the vLLM backend with ``model_settings``' options."""
    return {
        "MESH_NATS_URL": server_url,
        "MESH_WORKER_NODE_ID": "gpu-worker",
        "MESH_WORKER_MODEL_BACKEND": "vllm",
        "MESH_WORKER_MODEL_PATH": str(path),
        "MESH_WORKER_MODEL_SLOTS": str(slots),
        "MESH_WORKER_MODEL_N_CTX": "2048",
        "MESH_WORKER_MODEL_GPU_MEMORY_UTILIZATION": str(share),
    }


async def run(
    *, concurrency: tuple[int, ...] = (1, 32), rounds: int = 3, tokens: int = 128
) -> dict[str, Any]:
    explicit = os.environ.get("MESH_BENCH_VLLM_MODEL")
    path = Path(explicit) if explicit else await asyncio.to_thread(hf_from_gguf)
    slots = max(concurrency) * 2
    tmp = bench_dir("mesh-bench-vllm-")
    server = Server(tmp / "store")
    await server.start()
    worker = MeshProcess(
        "worker", "gpu-worker", worker_env(server.url, path, 0.3, slots), tmp / "worker.log"
    )
    backend = VLLMBackend(model_settings(path, 0.3, slots))
    samples: dict[tuple[str, int], list[Timed]] = {}
    walls: dict[tuple[str, int], float] = {}
    try:
        # One engine after the other: started together on one H100, the worker had not
        # announced itself 600 s later (its log was not kept); one by one, both start in ~45 s.
        await backend.start()
        await worker.start()
        settings = load_settings({("nats", "url"): server.url}, environ={})
        async with Connection(settings.nats, "bench-probe") as conn:
            await wait_for_worker(conn, "gpu-worker", timeout=300, process=worker)
        async with MeshClient(settings=settings, first_event_timeout=120, idle_timeout=120) as c:

            async def batch(path_name: str, n: int) -> list[Timed]:
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                if path_name == "direct":
                    calls = [_direct(backend, p, tokens) for p in prompts]
                else:
                    calls = [
                        timed_stream(c, p, via="cloud", max_tokens=tokens, temperature=0)
                        for p in prompts
                    ]
                began = time.perf_counter()
                results = list(await asyncio.gather(*calls))
                walls[(path_name, n)] = walls.get((path_name, n), 0.0) + (
                    time.perf_counter() - began
                )
                return results

            for name in ("direct", "mesh"):  # warm both (CUDA graphs, prefix caches)
                await batch(name, max(concurrency))
            walls.clear()
            for r in range(rounds):
                for n in concurrency:
                    order = ("direct", "mesh") if r % 2 == 0 else ("mesh", "direct")
                    for name in order:
                        samples.setdefault((name, n), []).extend(await batch(name, n))
    finally:
        await backend.close()
        await worker.stop(timeout=60)
        await server.stop()
    results: dict[str, Any] = {"model": path.name, "tokens": tokens, "rounds": rounds}
    for (name, n), rows in samples.items():
        results[f"{name}@{n}"] = {
            "ttft_p50_ms": pct([t.ttft for t in rows], 0.5) * 1000,
            "ttft_p99_ms": pct([t.ttft for t in rows], 0.99) * 1000,
            "total_p50_ms": pct([t.total for t in rows], 0.5) * 1000,
            "tokens_per_s": sum(t.tokens for t in rows) / walls[(name, n)],
            "tokens": sum(t.tokens for t in rows),
        }
    for n in concurrency:
        direct, mesh = results[f"direct@{n}"], results[f"mesh@{n}"]
        results[f"added@{n}"] = {
            "ttft_p50_ms": mesh["ttft_p50_ms"] - direct["ttft_p50_ms"],
            "ttft_p99_ms": mesh["ttft_p99_ms"] - direct["ttft_p99_ms"],
            "tokens_per_s_of_direct": mesh["tokens_per_s"] / direct["tokens_per_s"],
        }
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for key, r in results.items():
        if not isinstance(r, dict) or key.startswith("added@"):
            continue
        name, n = key.split("@")
        rows.append(
            [name, int(n), r["ttft_p50_ms"], r["ttft_p99_ms"], r["total_p50_ms"], r["tokens_per_s"]]
        )
    added = [
        f"{key.split('@')[1]} streams: mesh adds {r['ttft_p50_ms']:+.2f} ms p50 / "
        f"{r['ttft_p99_ms']:+.2f} ms p99 TTFT, {r['tokens_per_s_of_direct']:.1%} of direct tok/s"
        for key, r in results.items()
        if key.startswith("added@")
    ]
    head = f"vLLM, model {results['model']}, {results['tokens']} tokens max, greedy"
    body = table(["path", "streams", "TTFT p50 ms", "TTFT p99 ms", "end p50 ms", "tok/s"], rows)
    return "\n".join([head, body, *added])
