"""``mesh bench cascade``: what mid-answer escalation costs in time to first token.

One process: a nats-server, a worker on the deterministic backend paced like a GPU engine
(50 ms prefill, 20 ms per token), and four edges sharing the bundled GGUF, taking turns on the
same prompts:

- ``local``: the router keeps it local, no hold (mid-answer escalation off);
- ``local, held``: kept local after holding the first ``window`` tokens (the model was sure);
- ``escalated mid-answer``: held, found unsure, finished by the cloud;
- ``cloud``: the router sent it to the cloud at once.

The alternative design, the cloud continuing from the local prefix, would show an escalated
answer's first token at the ``local`` TTFT, but that token would be the local model's.
"""

from __future__ import annotations

import time
from typing import Any

from mesh_app.bench.common import bench_dir, pct, table

PROMPTS = (
    "Say hello to a new user.",
    "Name three fruits.",
    "Give me a short tip for sleeping well.",
    "What is the boiling point of water?",
)


async def run(*, rounds: int = 12, window: int = 8, tokens: int = 24) -> dict[str, Any]:
    from cloud_node.worker import Worker
    from edge_node.node import EdgeNode
    from edge_node.routing import create_router
    from mesh.backends.deterministic import DeterministicBackend
    from mesh.backends.llama_cpp import LlamaCppBackend
    from mesh.client import MeshClient
    from mesh.config import ConfidenceSettings, ModelSettings, load_settings
    from mesh.connection import Connection
    from mesh.testing.chaos import Server
    from protocol.messages import TokenEvent

    tmp = bench_dir("mesh-bench-cascade-")
    server = Server(tmp / "store")
    await server.start()
    base = load_settings({("nats", "url"): server.url, ("edge", "http_port"): -1}, environ={})
    edge_model = LlamaCppBackend(base.edge.model.model_copy(update={"n_threads": 1}))
    await edge_model.start()
    cloud = DeterministicBackend(
        ModelSettings(
            backend="deterministic", slots=8, prefill_delay_ms=50, token_delay_ms=20, faults=False
        )
    )
    modes = {
        "local": None,
        "local, held": ConfidenceSettings(enabled=True, window_tokens=window, max_mean_entropy=99),
        "escalated mid-answer": ConfidenceSettings(
            enabled=True, window_tokens=window, max_mean_entropy=0
        ),
        "cloud": None,
    }
    samples: dict[str, list[float]] = {name: [] for name in modes}
    try:
        async with Connection(base.nats, "bench-cascade") as conn:
            edges = []
            for i, (name, confidence) in enumerate(modes.items()):
                settings = base.model_copy(deep=True)
                settings.edge.edge_id = f"cascade{i}"
                settings.edge.router.threshold = 0.0 if name == "cloud" else 1.0
                if confidence is not None:
                    settings.edge.router.confidence = confidence
                edges.append(
                    (
                        name,
                        settings,
                        EdgeNode(settings, conn, edge_model, create_router(settings.edge.router)),
                    )
                )
            async with Worker(base, conn, cloud):
                for _name, _settings, edge in edges:
                    await edge.start()
                try:
                    for r in range(rounds + 1):  # round 0 warms every path
                        for name, settings, _edge in edges[r % 4 :] + edges[: r % 4]:
                            async with MeshClient(settings=settings, connection=conn) as client:
                                began = time.perf_counter()
                                first = None
                                async for event in client.stream(
                                    PROMPTS[r % len(PROMPTS)], max_tokens=tokens, temperature=0
                                ):
                                    if first is None and isinstance(event, TokenEvent):
                                        first = time.perf_counter()
                            if r and first is not None:
                                samples[name].append((first - began) * 1000)
                finally:
                    for _name, _settings, edge in edges:
                        await edge.stop()
    finally:
        await edge_model.close()
        await server.stop()
    return {
        "window": window,
        "rounds": rounds,
        **{
            name: {"ttft_p50_ms": pct(v, 0.5), "ttft_p99_ms": pct(v, 0.99), "n": len(v)}
            for name, v in samples.items()
        },
    }


def render(results: dict[str, Any]) -> str:
    rows = [
        [name, r["ttft_p50_ms"], r["ttft_p99_ms"], r["n"]]
        for name, r in results.items()
        if isinstance(r, dict)
    ]
    head = (
        f"mid-answer escalation, window {results['window']} tokens (bundled GGUF, 1 thread; "
        "cloud: deterministic, 50 ms prefill, 20 ms/token)"
    )
    return head + "\n" + table(["path", "TTFT p50 ms", "TTFT p99 ms", "n"], rows)
