"""``mesh bench overload``: offered load far above capacity, and what becomes of every request.

One worker process with ``slots`` slots in front of the deterministic server, a work queue
bounded to ``queue`` messages, and clients offering ``multiple`` x slots requests at once.
Reported per multiple: accepted (queued), completed, rejected with a retry-after (the queue
was full), lost (must be 0), queue wait p50/p99, and the worker's RSS before and after.
"""

from __future__ import annotations

import asyncio
from typing import Any

from mesh.client import MeshClient
from mesh_app.bench.common import bench_mesh, pct, rss_mib, table
from protocol.errors import MeshError, MeshTimeoutError, OverloadedError
from protocol.messages import EndEvent


async def run(
    *, slots: int = 8, queue: int = 40, multiples: tuple[int, ...] = (1, 4, 10), tokens: int = 20
) -> dict[str, Any]:
    results: dict[str, Any] = {"slots": slots, "queue": queue, "tokens": tokens}
    env = {"MESH_STREAM_MAX_MSGS": str(queue)}
    async with (
        bench_mesh(prefill_ms=20, token_ms=10, slots=slots, worker_env=env) as mesh,
        MeshClient(settings=mesh.settings, first_event_timeout=120, idle_timeout=60) as client,
    ):

        async def one(tag: str) -> tuple[str, float | None, float | None]:
            try:
                end: EndEvent | None = None
                async for event in client.stream(
                    f"[tag:{tag}] load", via="cloud", max_tokens=tokens
                ):
                    if isinstance(event, EndEvent):
                        end = event
            except OverloadedError as err:
                return "rejected", None, err.retry_after
            except MeshTimeoutError:
                return "lost", None, None
            except MeshError:
                return "error", None, None
            return "completed", end.timings.queue_ms if end else None, None

        before = rss_mib(mesh.worker.pid)
        for multiple in multiples:
            outcomes = await asyncio.gather(
                *(one(f"m{multiple}x{i}") for i in range(multiple * slots))
            )
            waits = [w for kind, w, _r in outcomes if kind == "completed" and w is not None]
            results[f"{multiple}x"] = {
                "offered": len(outcomes),
                "accepted": sum(1 for k, _w, _r in outcomes if k != "rejected"),
                "completed": sum(1 for k, _w, _r in outcomes if k == "completed"),
                "rejected": sum(1 for k, _w, _r in outcomes if k == "rejected"),
                "rejected_with_retry_after": sum(
                    1 for k, _w, r in outcomes if k == "rejected" and r
                ),
                "lost": sum(1 for k, _w, _r in outcomes if k == "lost"),
                "errors": sum(1 for k, _w, _r in outcomes if k == "error"),
                "queue_wait_p50_ms": pct(waits, 0.5),
                "queue_wait_p99_ms": pct(waits, 0.99),
            }
        results["worker_rss_mib"] = {"before": before, "after": rss_mib(mesh.worker.pid)}
    return results


def render(results: dict[str, Any]) -> str:
    rows = [
        [
            name,
            r["offered"],
            r["accepted"],
            r["completed"],
            r["rejected"],
            r["rejected_with_retry_after"],
            r["lost"],
            r["queue_wait_p50_ms"],
            r["queue_wait_p99_ms"],
        ]
        for name, r in results.items()
        if name.endswith("x")
    ]
    rss = results["worker_rss_mib"]
    head = (
        f"overload: {results['slots']} slots, queue bounded to {results['queue']}, "
        f"{results['tokens']} tokens each"
    )
    return (
        head
        + "\n"
        + table(
            [
                "load",
                "offered",
                "accepted",
                "completed",
                "rejected",
                "w/ retry-after",
                "lost",
                "wait p50 ms",
                "wait p99 ms",
            ],
            rows,
        )
        + f"\nworker RSS: {rss['before']:.1f} MiB before, {rss['after']:.1f} MiB after"
    )
