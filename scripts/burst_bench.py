"""Bursts of requests through a mesh of processes: time to first token, the time between tokens,
the whole answer, and the CPU each process spends a request.

A development tool, not part of the mesh. A ``mesh worker`` and a ``mesh edge`` process run
against one nats-server and the deterministic OpenAI-compatible server (as ``mesh bench paths``
runs them); this process is the SDK. It sends ``--streams`` requests at once, waits for every
answer, pauses 20 ms and sends the next burst, ``--requests`` in all after ``--warmup`` more.
Every answer must come whole (as many tokens as asked), or it stops with an error.

``--worker-gap-ms`` and ``--gap-ms`` set ``MESH_NATS_WRITE_GAP_MS`` for the worker and for the
edge (unset: each role's default, :mod:`mesh.write_batch`); the figures of the write gap in
``docs/performance.md`` came from runs of this script taken in turn, for example:

    python scripts/burst_bench.py --worker-gap-ms 1 --gap-ms 1
    python scripts/burst_bench.py

``--window-ms W`` also reads each process's CPU time (``/proc/<pid>/task/*/schedstat``, in
nanoseconds, every thread: nats-server is Go) at each counted burst's start and ``W`` ms after,
and prints the mean a burst spends there: the CPU the processes compete for while a burst's
requests make their way to the engine (``docs/performance.md``, issue 25's seventeenth stop).

Read one run with care: on a shared 2-core machine a run's figures move by 10% and more.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mesh.client import MeshClient
from mesh_app.bench.common import bench_mesh, cpu_seconds, pct
from protocol.messages import EndEvent, TokenEvent

ENV = "MESH_NATS_WRITE_GAP_MS"


class Figures:
    """What the client saw, in ms: each answer's TTFT and whole time, every gap between tokens."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.total: list[float] = []
        self.between: list[float] = []

    def clear(self) -> None:
        self.ttft.clear()
        self.total.clear()
        self.between.clear()


async def one(client: MeshClient, prompt: str, tokens: int, seen: Figures, kw: Any) -> None:
    began = time.perf_counter()
    times: list[float] = []
    end: EndEvent | None = None
    async for event in client.stream(prompt, max_tokens=tokens, **kw):
        if isinstance(event, TokenEvent):
            times.append(time.perf_counter())
        elif isinstance(event, EndEvent):
            end = event
    if end is None or end.usage.completion_tokens != tokens or not times:
        raise SystemExit(f"an answer did not come whole: {end!r}")
    seen.ttft.append((times[0] - began) * 1000)
    seen.total.append((time.perf_counter() - began) * 1000)
    seen.between.extend((b - a) * 1000 for a, b in itertools.pairwise(times))


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in nanoseconds (finer than ``/proc``'s
    10 ms ticks); 0 for a thread gone meanwhile."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


class Window:
    """Each process's CPU in the first ``ms`` of every burst it is asked to watch."""

    def __init__(self, ms: float, pids: dict[str, int]) -> None:
        self.ms = ms
        self.pids = pids
        self.spent = dict.fromkeys(pids, 0.0)
        self.read_at: list[float] = []

    def watch(self) -> None:
        """From now (a burst's start) to ``ms`` later, read when the loop gets there."""
        began = time.perf_counter()
        first = {name: cpu_ns(pid) for name, pid in self.pids.items()}

        def read() -> None:
            self.read_at.append((time.perf_counter() - began) * 1000)
            for name, pid in self.pids.items():
                self.spent[name] += (cpu_ns(pid) - first[name]) / 1e6

        asyncio.get_running_loop().call_later(self.ms / 1000, read)

    def figures(self) -> dict[str, Any]:
        bursts = max(1, len(self.read_at))
        return {
            "ms": self.ms,
            "bursts": len(self.read_at),
            "read_at_ms_p50": pct(self.read_at, 0.5) if self.read_at else None,
            "cpu_ms_per_burst": {name: ms / bursts for name, ms in self.spent.items()},
        }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.gap_ms is not None:
        os.environ[ENV] = str(args.gap_ms)  # the edge's (its process inherits this environment)
    worker_env = {ENV: str(args.worker_gap_ms)} if args.worker_gap_ms is not None else None
    seen = Figures()
    settings = {"prefill_ms": args.prefill_ms, "token_ms": args.token_ms, "slots": 32}
    async with (
        bench_mesh(**settings, worker_env=worker_env) as mesh,
        MeshClient(settings=mesh.settings) as client,
    ):
        kw = {"route": "cloud"} if args.via == "edge" else {"via": "cloud"}

        pids = {"edge": mesh.edge.pid, "worker": mesh.worker.pid, "server": mesh.server.pid}
        watched = {name: pid for name, pid in pids.items() if pid is not None}
        window = Window(args.window_ms, {**watched, "sdk": os.getpid()}) if args.window_ms else None

        async def bursts(count: int, watched: Window | None = None) -> None:
            for burst in range(count // args.streams):
                prompts = (f"burst {burst} request {i}" for i in range(args.streams))
                if watched is not None:
                    watched.watch()
                await asyncio.gather(*(one(client, p, args.tokens, seen, kw) for p in prompts))
                await asyncio.sleep(0.02)

        await bursts(args.warmup)
        seen.clear()
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        before["sdk"] = cpu_seconds()
        await bursts(args.requests, window)
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        after["sdk"] = cpu_seconds()
    answered = len(seen.ttft)
    return {
        "via": args.via,
        "answers": answered,
        "gap_ms": args.gap_ms,
        "worker_gap_ms": args.worker_gap_ms,
        "ttft_ms": {"p50": pct(seen.ttft, 0.5), "p99": pct(seen.ttft, 0.99)},
        "between_tokens_ms": {
            q: pct(seen.between, f) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "total_ms": {"p50": pct(seen.total, 0.5), "p99": pct(seen.total, 0.99)},
        "cpu_ms_per_request": {
            name: (after[name] - before[name]) * 1000 / max(1, answered) for name in after
        },
        "window": window.figures() if window is not None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=("edge", "cloud"), default="edge")
    parser.add_argument("--streams", type=int, default=32, help="requests a burst")
    parser.add_argument("--requests", type=int, default=640, help="requests counted")
    parser.add_argument("--warmup", type=int, default=64, help="requests before, not counted")
    parser.add_argument("--tokens", type=int, default=32, help="tokens an answer")
    parser.add_argument("--prefill-ms", type=float, default=50.0)
    parser.add_argument("--token-ms", type=float, default=20.0)
    parser.add_argument("--gap-ms", type=float, default=None, help="the edge's write gap")
    parser.add_argument("--worker-gap-ms", type=float, default=None, help="the worker's")
    parser.add_argument(
        "--window-ms", type=float, default=None, help="also each process's CPU in a burst's start"
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    ttft, between, total = figures["ttft_ms"], figures["between_tokens_ms"], figures["total_ms"]
    cpu = figures["cpu_ms_per_request"]
    print(
        f"via {args.via}, {figures['answers']} answers of {args.tokens} tokens in bursts of "
        f"{args.streams} (write gap: worker {args.worker_gap_ms}, edge {args.gap_ms} ms; None: "
        "the role's default)"
    )
    print(f"  TTFT p50 {ttft['p50']:.2f} ms, p99 {ttft['p99']:.2f}")
    print(
        f"  between tokens p50 {between['p50']:.2f} ms, p90 {between['p90']:.2f}, "
        f"p99 {between['p99']:.2f}"
    )
    print(f"  whole answer p50 {total['p50']:.1f} ms, p99 {total['p99']:.1f}")
    print("  CPU a request (ms): " + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu.items()))
    window = figures["window"]
    if window is not None:
        spent = ", ".join(f"{n} {ms:.2f}" for n, ms in window["cpu_ms_per_burst"].items())
        print(
            f"  CPU in a burst's first {window['ms']:g} ms (ms, mean of {window['bursts']} "
            f"bursts, read at {window['read_at_ms_p50']:.1f} ms p50): {spent}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
