"""What every ``mesh bench`` part shares: percentiles, timing one answer, tables, a mesh of
real processes in front of the deterministic server."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.client import MeshClient
from mesh.config import MeshSettings, load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, Server, edge_env, wait_for_edge, wait_for_worker
from protocol.messages import EndEvent, TokenEvent


def bench_dir(prefix: str) -> Path:
    """A new temporary directory for a bench's stores and logs, removed when the process exits
    (a run of ``mesh bench`` left every one behind: tens of megabytes each)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(
                c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)
            )
        )
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").replace("+", "").isdigit()


@dataclass
class Timed:
    ttft: float  # seconds from sending to the first token
    total: float  # seconds from sending to the end
    tokens: int


async def timed_stream(client: MeshClient, prompt: str, **kwargs: Any) -> Timed:
    """One request through the SDK, timed at the client."""
    began = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for event in client.stream(prompt, **kwargs):
        if isinstance(event, TokenEvent):
            first = first or time.perf_counter()
        elif isinstance(event, EndEvent):
            tokens = event.usage.completion_tokens
    done = time.perf_counter()
    return Timed(ttft=(first or done) - began, total=done - began, tokens=tokens)


def split_by_length(short: float, long: float, short_n: int, long_n: int) -> tuple[float, float]:
    """The straight line through a cost at two answer lengths (``short`` at ``short_n`` tokens,
    ``long`` at ``long_n``): the part per token (the slope) and the fixed part per request, in
    the units given."""
    per_token = (long - short) / (long_n - short_n)
    return per_token, short - short_n * per_token


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (``pid`` None) or of another one."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def wakeups(pid: int) -> int:
    """How many times process ``pid`` went to sleep and was woken, all its threads together
    (voluntary context switches): a count, which the other processes' load does not distort
    as CPU time is. A thread that ends while it is read counts no more."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class BenchMesh:
    """nats-server, a deterministic OpenAI-compatible server, a worker on it, an edge."""

    server: Server
    backend_url: str
    settings: MeshSettings
    worker: MeshProcess
    edge: MeshProcess


def bench_worker_env(nats_url: str, backend_url: str, slots: int, node_id: str) -> dict[str, str]:
    """A bench worker's environment: ``node_id`` on the OpenAI-compatible server at
    ``backend_url``, ``slots`` requests at a time."""
    return {
        "MESH_NATS_URL": nats_url,
        "MESH_WORKER_NODE_ID": node_id,
        "MESH_WORKER_MODEL_BACKEND": "openai",
        "MESH_WORKER_MODEL_BASE_URL": backend_url,
        "MESH_WORKER_MODEL_SLOTS": str(slots),
        "MESH_WORKER_MODEL_CONTINUATION": "vllm",
        "MESH_LOG_LEVEL": "warning",
    }


@contextlib.asynccontextmanager
async def openai_backend(
    *, prefill_ms: float, token_ms: float, lockstep: bool = False
) -> AsyncIterator[str]:
    """The deterministic OpenAI-compatible server as a process of its own; yields its base URL.
    ``lockstep``: every answer's tokens on one clock, as a batching engine steps them."""
    backend = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh.testing.openai_server",
        "--prefill-ms",
        str(prefill_ms),
        "--token-ms",
        str(token_ms),
        *(["--lockstep"] if lockstep else []),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert backend.stdout is not None
        port = int((await asyncio.wait_for(backend.stdout.readline(), 30)).split()[-1])
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            backend.kill()
        await backend.wait()


@contextlib.asynccontextmanager
async def bench_mesh(
    *,
    prefill_ms: float,
    token_ms: float,
    slots: int,
    worker_env: dict[str, str] | None = None,
    lockstep: bool = False,
) -> AsyncIterator[BenchMesh]:
    """Everything as separate processes, as deployed; the bench process only runs clients."""
    tmp = bench_dir("mesh-bench-")
    server = Server(tmp / "store")
    await server.start()
    processes: list[MeshProcess] = []
    try:
        async with openai_backend(
            prefill_ms=prefill_ms, token_ms=token_ms, lockstep=lockstep
        ) as url:
            settings = load_settings(
                {("nats", "url"): server.url, ("edge", "edge_id"): "bench"}, environ={}
            )
            env = {**bench_worker_env(server.url, url, slots, "bench-worker"), **(worker_env or {})}
            worker = MeshProcess("worker", "bench-worker", env, tmp / "worker.log")
            edge = MeshProcess(
                "edge",
                "bench",
                {**edge_env(server.url, "bench"), "MESH_LOG_LEVEL": "warning"},
                tmp / "edge.log",
            )
            try:
                processes += [await worker.start(), await edge.start()]
                async with Connection(settings.nats, "bench-probe") as conn:
                    await wait_for_worker(conn, "bench-worker")
                    await wait_for_edge(conn, "bench")
                yield BenchMesh(server, url, settings, worker, edge)
            finally:
                await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)
    finally:
        await server.stop()
