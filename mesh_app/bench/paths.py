"""``mesh bench paths``: what the mesh adds over calling the engine's HTTP API directly.

Three ways to the same deterministic OpenAI-compatible server (``mesh.testing.openai_server``,
a benchmark backend, not a model: 50 ms prefill, 50 tokens/s per stream by default):

- direct: HTTP SSE straight to the server, what a vLLM user would do instead;
- via cloud: SDK -> JetStream -> worker -> token subject -> SDK;
- via edge: SDK -> edge -> JetStream -> worker -> edge -> SDK (route=cloud);
- bare relay: the floor for any relay over NATS on this machine, not an alternative: a
  request on a core subject to a bare nats-py process that calls the same server and publishes
  each token to the reply inbox. No queue, no store, no checks: what the hops alone cost.
- bare queue: the bare relay taking its requests from a JetStream work queue instead, written
  plainly with nats-py's JetStream API (the client awaits ``js.publish``'s ack, the relay
  ``fetch``es one message at a time and acks once the answer is out): what the broker alone
  adds to a lone request "via cloud". Not a floor under load: at 32 streams the worker's pulls
  (batched, renewed in its read loop) have read faster than it. Its CPU is the "bare relay"
  column, in its own turn.
- bare middle: the bare relay behind a bare nats-py process that receives each of its messages
  and publishes it again to the client: the floor for a hop in the middle, what an edge is
  (its CPU is the "bare middle" column).
- bare queued middle: the bare middle handing each request to the bare queue instead (its ack
  awaited, a task per request): the bare paths composed in the shape of a request an edge
  escalates, the floor "via edge" is set beside (the middle's CPU in the "bare middle" column,
  the relay's in "bare relay").

At each concurrency the paths take turns, round after round, so they see the same load. Each
process's CPU time is read (``/proc``) around each path's turn, so that every path gets the CPU
its requests cost: the bench process (the SDK, the bare client or aiohttp), nats-server, the
worker, the edge and the bare relay, in milliseconds per request.

With a second answer length (``--split``), every path runs at both lengths in each round, in
turn, and each process's CPU is split into a part per token (the slope between the two lengths)
and a fixed part per request, beside the same split of its floor: a worker's against the bare
relay process, an edge's against the bare middle process, the SDK's against the bench process
reading the bare relay. Both lengths in one run see the same minutes of a shared machine; two
runs minutes apart do not.

``--pacing lockstep`` makes the server emit every answer's next token at the same moments, as a
batching engine (vLLM) makes one token of each running answer per step; by default each answer
keeps a clock of its own, from the moment its request reached the server.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp

from mesh.client import MeshClient
from mesh_app.bench.bare import MIDDLE_SUBJECT, QUEUED_MIDDLE_SUBJECT, bare, bare_process, deltas
from mesh_app.bench.common import (
    Timed,
    bench_mesh,
    cpu_seconds,
    pct,
    split_by_length,
    table,
    timed_stream,
)

PATHS = (
    "direct",
    "bare relay",
    "bare queue",
    "bare middle",
    "bare queued middle",
    "via cloud",
    "via edge",
)
PROCESSES = ("bench", "nats-server", "worker", "edge", "bare relay", "bare middle")
"""Whose CPU is read: ``bench`` is this process, which runs every path's clients."""
SPLIT_ROWS = (
    # (row, the path, whose CPU; its floor: the path, whose CPU)
    ("worker, via cloud", "via cloud", "worker", "bare relay", "bare relay"),
    ("worker, via edge", "via edge", "worker", "bare relay", "bare relay"),
    ("edge, via edge", "via edge", "edge", "bare middle", "bare middle"),
    ("SDK, via cloud", "via cloud", "bench", "bare relay", "bench"),
    ("SDK, via edge", "via edge", "bench", "bare middle", "bench"),
    ("nats-server, via cloud", "via cloud", "nats-server", "bare relay", "nats-server"),
    ("nats-server, via edge", "via edge", "nats-server", "bare middle", "nats-server"),
    ("bare relay, via a queue", "bare queue", "bare relay", "bare relay", "bare relay"),
    ("nats-server, bare queue", "bare queue", "nats-server", "bare relay", "nats-server"),
)
"""What ``--split`` sets beside what: each mesh process on its path against the same role's
bare process on the floor's path (the bench process is the SDK's clients on the mesh paths and
a bare nats-py reader on the bare ones)."""


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
            for _text in deltas(raw):
                first = first or time.perf_counter()
                got += 1
    done = time.perf_counter()
    return Timed(ttft=(first or done) - began, total=done - began, tokens=got)


async def run(
    *,
    concurrency: tuple[int, ...] = (1, 32),
    rounds: int = 10,
    tokens: int = 32,
    split: int | None = None,
    prefill_ms: float = 50.0,
    token_ms: float = 20.0,
    pacing: str = "stream",
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "backend": {"prefill_ms": prefill_ms, "token_ms": token_ms, "pacing": pacing}
    }
    results["tokens"] = tokens
    lengths = (tokens,) if split is None or split == tokens else (tokens, split)
    async with (
        bench_mesh(
            prefill_ms=prefill_ms,
            token_ms=token_ms,
            slots=max(concurrency),
            lockstep=pacing == "lockstep",
        ) as mesh,
        bare_process("--bare", mesh.server.url, mesh.backend_url) as bare_pid,
        bare_process("--middle", mesh.server.url) as middle_pid,
        MeshClient(settings=mesh.settings, first_event_timeout=60, idle_timeout=60) as client,
        aiohttp.ClientSession() as session,
    ):
        prompt = "[tag:b] benchmark"
        nc = client.conn.nc
        pids = {
            "bench": None,
            "nats-server": mesh.server.pid,
            "worker": mesh.worker.pid,
            "edge": mesh.edge.pid,
            "bare relay": bare_pid,
            "bare middle": middle_pid,
        }

        def cpu() -> dict[str, float]:
            return {name: cpu_seconds(pid) for name, pid in pids.items()}

        async def one(path: str, length: int) -> Timed:
            if path == "direct":
                return await direct(session, mesh.backend_url, prompt, length)
            if path == "bare relay":
                return await bare(nc, prompt, length)
            if path == "bare queue":
                return await bare(nc, prompt, length, queued=True)
            if path == "bare middle":
                return await bare(nc, prompt, length, MIDDLE_SUBJECT)
            if path == "bare queued middle":
                return await bare(nc, prompt, length, QUEUED_MIDDLE_SUBJECT)
            if path == "via cloud":
                return await timed_stream(client, prompt, via="cloud", max_tokens=length)
            return await timed_stream(client, prompt, route="cloud", max_tokens=length)

        for path in PATHS:  # warm connections, consumers and caches
            for _ in range(3):
                await one(path, tokens)
        for streams in concurrency:
            samples: dict[tuple[int, str], list[Timed]] = {
                (n, p): [] for n in lengths for p in PATHS
            }
            spent = {(n, p): dict.fromkeys(PROCESSES, 0.0) for n in lengths for p in PATHS}
            for r in range(rounds):
                order = PATHS[r % len(PATHS) :] + PATHS[: r % len(PATHS)]
                for path in order:
                    for n in lengths if r % 2 == 0 else lengths[::-1]:
                        before = cpu()
                        samples[n, path] += await asyncio.gather(
                            *(one(path, n) for _ in range(streams))
                        )
                        after = cpu()
                        for name in PROCESSES:
                            spent[n, path][name] += after[name] - before[name]
            for n in lengths:
                figures = _summarize({p: samples[n, p] for p in PATHS}, n)
                for path in PATHS:
                    count = len(samples[n, path])
                    per = {name: 1000 * sec / count for name, sec in spent[n, path].items()}
                    figures[path]["cpu_ms_per_request"] = per
                if n == tokens:
                    results[str(streams)] = figures
                else:
                    results.setdefault("at_split", {})[str(streams)] = figures
            if len(lengths) == 2:
                results.setdefault("per_token", {})[str(streams)] = split_cpu(
                    results[str(streams)], results["at_split"][str(streams)], *lengths
                )
    if len(lengths) == 2:
        results["split_tokens"] = lengths[1]
    return results


def split_cpu(
    short: dict[str, Any], long: dict[str, Any], short_n: int, long_n: int
) -> dict[str, dict[str, float]]:
    """Each :data:`SPLIT_ROWS` process's CPU per token (us, the slope between the two answer
    lengths) and fixed CPU per request (ms), its floor's, and the ratio of the two per token."""

    def cut(path: str, whose: str) -> tuple[float, float]:
        per_token_ms, fixed_ms = split_by_length(
            short[path]["cpu_ms_per_request"][whose],
            long[path]["cpu_ms_per_request"][whose],
            short_n,
            long_n,
        )
        return 1000 * per_token_ms, fixed_ms

    out: dict[str, dict[str, float]] = {}
    for row, path, whose, floor_path, floor_whose in SPLIT_ROWS:
        per_token, fixed = cut(path, whose)
        floor_per_token, floor_fixed = cut(floor_path, floor_whose)
        out[row] = {
            "per_token_us": per_token,
            "fixed_ms": fixed,
            "floor_per_token_us": floor_per_token,
            "floor_fixed_ms": floor_fixed,
            "of_floor": per_token / floor_per_token if floor_per_token > 0 else float("nan"),
        }
    return out


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
    for path in ("bare queue", "bare queued middle", "via cloud", "via edge"):
        floor = out["bare relay"]
        out[path]["over_bare_ttft_p50_ms"] = out[path]["ttft_p50_ms"] - floor["ttft_p50_ms"]
        out[path]["over_bare_ttft_p99_ms"] = out[path]["ttft_p99_ms"] - floor["ttft_p99_ms"]
    queue = out["bare queue"]
    out["via cloud"]["over_queue_ttft_p50_ms"] = (
        out["via cloud"]["ttft_p50_ms"] - queue["ttft_p50_ms"]
    )
    out["via cloud"]["over_queue_ttft_p99_ms"] = (
        out["via cloud"]["ttft_p99_ms"] - queue["ttft_p99_ms"]
    )
    chain = out["bare queued middle"]
    out["via edge"]["over_chain_ttft_p50_ms"] = (
        out["via edge"]["ttft_p50_ms"] - chain["ttft_p50_ms"]
    )
    out["via edge"]["over_chain_ttft_p99_ms"] = (
        out["via edge"]["ttft_p99_ms"] - chain["ttft_p99_ms"]
    )
    out["direct"]["n_base"] = len(base)
    return out


def _runs(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(streams, figures by path) for each concurrency run."""
    extras = ("backend", "tokens", "split_tokens", "at_split", "per_token")
    return [(k, v) for k, v in results.items() if k not in extras]


def render(results: dict[str, Any]) -> str:
    rows = []
    for streams, by_path in _runs(results):
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
        f"{1000 / b['token_ms']:g} tokens/s per stream"
        + (", in lockstep" if b.get("pacing") == "lockstep" else "")
        + "; milliseconds"
    )
    notes = [_over_floors(streams, by_path) for streams, by_path in _runs(results)]
    cpu_rows = [
        [
            streams,
            path,
            *(by_path[path]["cpu_ms_per_request"][name] for name in PROCESSES),
            sum(by_path[path]["cpu_ms_per_request"].values()),
        ]
        for streams, by_path in _runs(results)
        for path in PATHS
    ]
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
        + "\n"
        + "\n".join(notes)
        + f"\n\nCPU per request, {results.get('tokens', '?')}-token answers (ms; each path's "
        f"turn; bench = the clients; /proc counts in {1000 / os.sysconf('SC_CLK_TCK'):g} ms "
        "ticks, so a figure settles only over many requests)\n"
        + table(["streams", "path", *PROCESSES, "total"], cpu_rows)
        + _render_split(results)
    )


def _over_floors(streams: str, by_path: dict[str, Any], what: str = "") -> str:
    """One line of TTFT differences: each queued or mesh path over the bare relay, the cloud
    path over the bare queue (what the mesh adds to the broker alone) and the edge path over the
    bare queued middle (what it adds to the same hops done bare)."""

    def over(path: str, floor: str) -> str:
        r = by_path[path]
        return (
            f"{path} {r[f'over_{floor}_ttft_p50_ms']:+.2f} / {r[f'over_{floor}_ttft_p99_ms']:+.2f}"
        )

    return (
        f"{streams} stream(s), {what}over the bare relay (TTFT p50 / p99): "
        + ", ".join(
            over(path, "bare")
            for path in ("bare queue", "bare queued middle", "via cloud", "via edge")
        )
        + f"; over the bare queue: {over('via cloud', 'queue')}"
        + f"; over the bare queued middle: {over('via edge', 'chain')}"
    )


def _render_split(results: dict[str, Any]) -> str:
    """The second length's TTFT over the bare relay, and the split table (``--split``)."""
    if "per_token" not in results:
        return ""
    short, long = results["tokens"], results["split_tokens"]
    notes = [
        _over_floors(streams, by_path, f"{long}-token answers, ")
        for streams, by_path in results["at_split"].items()
    ]
    rows = [
        [
            streams,
            row,
            f"{r['per_token_us']:.1f}",
            f"{r['fixed_ms']:.2f}",
            f"{r['floor_per_token_us']:.1f}",
            f"{r['floor_fixed_ms']:.2f}",
            f"{r['of_floor']:.2f}x",
        ]
        for streams, by_row in results["per_token"].items()
        for row, r in by_row.items()
    ]
    return (
        "\n\n"
        + "\n".join(notes)
        + f"\n\nCPU split by answer length ({short} and {long} tokens, in turn in every "
        "round): per token (us, the slope) and fixed per request (ms), beside the same process "
        "role on its floor's path (see SPLIT_ROWS)\n"
        + table(
            ["streams", "process, path", "per token", "fixed", "floor/token", "floor fixed", "x"],
            rows,
        )
    )
