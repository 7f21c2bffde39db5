"""``mesh bench relay``: how fast answers move from one worker process to its clients.

A worker process on the deterministic backend with no delays (it yields tokens as fast as it
can) streams to SDK clients in this process, with coalescing on (16 tokens or 5 ms per message)
and off. Next to it, round after round in turn, the ceiling: a bare nats-py publisher process
sending the same token events (same coalescing) to plain subscribers here. Reported: tokens/s,
and CPU seconds per 10k tokens in the sending process, in this one and in the server.

Then the same through HTTP, as a worker in front of vLLM runs: a worker on the deterministic
OpenAI-compatible server (no delays, one SSE event per token, coalescing as deployed) against
its floor, the bare relay of ``mesh bench paths`` (aiohttp SSE in, one nats-py publish per
event out) on the same server, round after round in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

import nats

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, Server, wait_for_worker
from mesh_app.bench.bare import bare, bare_process
from mesh_app.bench.common import (
    Timed,
    bench_dir,
    bench_worker_env,
    cpu_seconds,
    openai_backend,
    table,
    timed_stream,
)
from protocol.codec import WireFormat, dump_token


class _Tally:
    """Tokens, wall time and CPU seconds (sender, this process, the server) over timed rounds."""

    def __init__(self) -> None:
        self.moved = 0
        self.wall = self.sender = self.client = self.server = 0.0

    def add(self, moved: int, wall: float, sender: float, client: float, server: float) -> None:
        self.moved += moved
        self.wall += wall
        self.sender += sender
        self.client += client
        self.server += server

    def figures(self) -> dict[str, float]:
        per_10k = 10_000 / self.moved
        return {
            "tokens": self.moved,
            "tokens_per_s": self.moved / self.wall,
            "sender_cpu_per_10k": self.sender * per_10k,
            "client_cpu_per_10k": self.client * per_10k,
            "server_cpu_per_10k": self.server * per_10k,
        }


async def _timed_round(
    sender_pid: int, server: Server, answers: Sequence[Awaitable[Timed]]
) -> tuple[int, float, float, float, float]:
    """Tokens, wall time and CPU seconds (the sending process, this one, the server) of one
    round of answers run at once."""
    cpu_w, cpu_c, cpu_s = cpu_seconds(sender_pid), cpu_seconds(), cpu_seconds(server.pid)
    began = time.perf_counter()
    rows = await asyncio.gather(*answers)
    wall = time.perf_counter() - began
    return (
        sum(r.tokens for r in rows),
        wall,
        cpu_seconds(sender_pid) - cpu_w,
        cpu_seconds() - cpu_c,
        cpu_seconds(server.pid) - cpu_s,
    )


async def _mesh_round(
    client: MeshClient, worker_pid: int, server: Server, *, name: str, streams: int, tokens: int
) -> tuple[int, float, float, float, float]:
    answers = [
        timed_stream(client, "[tag:r] go", via="cloud", model=name, max_tokens=tokens)
        for _ in range(streams)
    ]
    return await _timed_round(worker_pid, server, answers)


class _Counter:
    """Counts one round's tokens arriving on the bare subscriptions."""

    def __init__(self, expected: int) -> None:
        self.remaining = expected
        self.done = asyncio.Event()

    async def on_msg(self, msg: Any) -> None:
        self.remaining -= int(msg.headers["n"]) if msg.headers else 0
        if self.remaining <= 0:
            self.done.set()


class _BareSender:
    """The bare publisher process, kept for all rounds (a fresh process per round ran cold)."""

    def __init__(self, server: Server, *, parts: int, streams: int, tokens: int) -> None:
        self.server = server
        self.args = [str(parts), str(streams), str(tokens)]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mesh_app.bench.relay",
            "--publish",
            self.server.url,
            *self.args,
            stdout=asyncio.subprocess.PIPE,
        )
        await self.line()  # connected, waiting for "go"

    async def line(self) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        return (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def _bare_round(
    nc: Any, sender: _BareSender, server: Server, *, streams: int, tokens: int
) -> tuple[int, float, float, float, float]:
    counter = _Counter(streams * tokens)
    subs = [await nc.subscribe(f"bare.{i}", cb=counter.on_msg) for i in range(streams)]
    await nc.flush()
    began, cpu_c, cpu_s = time.perf_counter(), cpu_seconds(), cpu_seconds(server.pid)
    await nc.publish("bare.go", b"")
    await asyncio.wait_for(counter.done.wait(), 120)
    wall, client_cpu = time.perf_counter() - began, cpu_seconds() - cpu_c
    server_cpu = cpu_seconds(server.pid) - cpu_s
    sender_cpu = float(await sender.line())  # it prints its CPU seconds for the round
    for sub in subs:
        await sub.unsubscribe()
    return streams * tokens, wall, sender_cpu, client_cpu, server_cpu


async def _side_by_side(
    server: Server, tmp: Path, *, parts: int, streams: int, tokens: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The mesh and the bare loop, round after round in turn, so that both see the same load."""
    name = f"relay-{parts}"
    env = {
        "MESH_NATS_URL": server.url,
        "MESH_WORKER_NODE_ID": name,
        "MESH_WORKER_MODEL_BACKEND": "deterministic",
        "MESH_WORKER_MODEL_NAME": name,
        "MESH_WORKER_MODEL_SLOTS": str(streams),
        "MESH_WORKER_COALESCE_TOKENS": str(parts),
        "MESH_WORKER_COALESCE_MS": "5" if parts > 1 else "0",
        "MESH_LOG_LEVEL": "warning",
    }
    worker = await MeshProcess("worker", name, env, tmp / f"{name}.log").start()
    settings = load_settings({("nats", "url"): server.url}, environ={})
    shape = {"streams": streams, "tokens": tokens}
    mesh, floor = _Tally(), _Tally()
    nc = await nats.connect(server.url)
    sender = _BareSender(server, parts=parts, **shape)
    try:
        await sender.start()
        async with Connection(settings.nats, "relay-probe") as conn:
            await wait_for_worker(conn, name)
        async with MeshClient(settings=settings) as client:
            for round_no in range(rounds + 1):  # round 0 warms up
                m = await _mesh_round(client, worker.pid, server, name=name, **shape)
                b = await _bare_round(nc, sender, server, **shape)
                if round_no:
                    mesh.add(*m)
                    floor.add(*b)
    finally:
        await sender.stop()
        await nc.close()
        await worker.stop()
    return mesh.figures(), floor.figures()


async def _http_side_by_side(
    server: Server, tmp: Path, *, streams: int, tokens: int, rounds: int
) -> tuple[dict[str, float], dict[str, float]]:
    """A worker on the OpenAI-compatible server against the bare relay on the same server."""
    name = "relay-http"
    settings = load_settings({("nats", "url"): server.url}, environ={})
    mesh, floor = _Tally(), _Tally()
    async with openai_backend(prefill_ms=0, token_ms=0) as url:
        env = {**bench_worker_env(server.url, url, streams, name), "MESH_WORKER_MODEL_NAME": name}
        worker = await MeshProcess("worker", name, env, tmp / f"{name}.log").start()
        try:
            async with (
                bare_process("--bare", server.url, url) as relay_pid,
                Connection(settings.nats, "relay-probe") as conn,
            ):
                await wait_for_worker(conn, name)
                async with MeshClient(settings=settings) as client:
                    for round_no in range(rounds + 1):  # round 0 warms up
                        m = await _mesh_round(
                            client, worker.pid, server, name=name, streams=streams, tokens=tokens
                        )
                        b = await _floor_round(conn.nc, relay_pid, server, streams, tokens)
                        if round_no:
                            mesh.add(*m)
                            floor.add(*b)
        finally:
            await worker.stop()
    return mesh.figures(), floor.figures()


async def _floor_round(
    nc: Any, relay_pid: int, server: Server, streams: int, tokens: int
) -> tuple[int, float, float, float, float]:
    answers = [bare(nc, "[tag:r] go", tokens) for _ in range(streams)]
    return await _timed_round(relay_pid, server, answers)


async def _publish(url: str, parts: int, streams: int, tokens: int) -> None:
    """The bare sender: the same token events the mesh sends, coalesced the same way; one round
    per "go", printing the CPU seconds it took."""
    nc = await nats.connect(url)
    go: asyncio.Queue[None] = asyncio.Queue()

    async def on_go(_msg: Any) -> None:
        go.put_nowait(None)

    await nc.subscribe("bare.go", cb=on_go)
    await nc.flush()
    print("ready", flush=True)
    while True:
        await go.get()
        started = cpu_seconds()
        for seq in range(0, tokens, parts):
            count = min(parts, tokens - seq)
            text = "".join(f" r{seq + k}" for k in range(count))
            for stream in range(streams):
                data = dump_token(f"bare{stream}", seq // parts, text, 1, WireFormat.MSGPACK, count)
                await nc.publish(f"bare.{stream}", data, headers={"n": str(count)})
            if seq % (parts * 64) == 0:
                await asyncio.sleep(0)
        await nc.flush()
        print(cpu_seconds() - started, flush=True)


HTTP_MESH = "mesh, HTTP backend (coalescing as deployed)"
HTTP_FLOOR = "bare relay, HTTP backend (aiohttp SSE -> nats-py)"


async def run(*, streams: int = 4, tokens: int = 4000, rounds: int = 30) -> dict[str, Any]:
    tmp = bench_dir("mesh-bench-relay-")
    server = Server(tmp / "store")
    await server.start()
    results: dict[str, Any] = {"streams": streams, "tokens": tokens}
    try:
        for label, parts in (("coalescing on (16, 5 ms)", 16), ("coalescing off", 1)):
            shape = {"parts": parts, "streams": streams, "tokens": tokens, "rounds": rounds}
            mesh, floor = await _side_by_side(server, tmp, **shape)
            results[f"mesh, {label}"], results[f"bare nats-py, {label}"] = mesh, floor
        results["http_tokens"] = tokens
        mesh, floor = await _http_side_by_side(
            server, tmp, streams=streams, tokens=tokens, rounds=max(1, rounds // 3)
        )
        results[HTTP_MESH], results[HTTP_FLOOR] = mesh, floor
    finally:
        await server.stop()
    for label in ("coalescing on (16, 5 ms)", "coalescing off"):
        mesh, floor = results[f"mesh, {label}"], results[f"bare nats-py, {label}"]
        mesh["share_of_bare"] = mesh["tokens_per_s"] / floor["tokens_per_s"]
    mesh, floor = results[HTTP_MESH], results[HTTP_FLOOR]
    mesh["share_of_bare"] = mesh["tokens_per_s"] / floor["tokens_per_s"]
    # /proc counts CPU in 10 ms ticks: a short run may read none for the floor.
    spent = floor["sender_cpu_per_10k"]
    mesh["sender_cpu_of_bare"] = mesh["sender_cpu_per_10k"] / spent if spent else float("nan")
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for label, r in results.items():
        if not isinstance(r, dict):
            continue
        rows.append(
            [
                label,
                r["tokens_per_s"],
                r["sender_cpu_per_10k"] * 1000,
                r["client_cpu_per_10k"] * 1000,
                r["server_cpu_per_10k"] * 1000,
                f"{r['share_of_bare']:.0%}" if "share_of_bare" in r else "",
            ]
        )
    head = (
        f"relay: {results['streams']} streams x {results['tokens']} tokens, one worker "
        "process (deterministic backend, no delays); through HTTP "
        f"{results['streams']} x {results['http_tokens']} tokens from the OpenAI-compatible "
        "server (no delays); CPU in ms per 10k tokens"
    )
    http = results[HTTP_MESH]
    tail = (
        f"through HTTP, the worker's CPU per token is {http['sender_cpu_of_bare']:.2f}x the "
        "bare relay's (the sender CPU column)"
    )
    return "\n".join(
        [
            head,
            table(["path", "tokens/s", "sender CPU", "client CPU", "server CPU", "of bare"], rows),
            tail,
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--publish", nargs=4, metavar=("URL", "PARTS", "STREAMS", "TOKENS"))
    args = parser.parse_args()
    url, parts, streams, tokens = args.publish
    asyncio.run(_publish(url, int(parts), int(streams), int(tokens)))
