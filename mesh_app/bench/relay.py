"""``mesh bench relay``: how fast answers move from one worker process to its clients.

A worker process on the deterministic backend with no delays (it yields tokens as fast as it
can) streams to SDK clients in this process, with coalescing on (16 tokens or 5 ms per message)
and off. Next to it, in the same run, the ceiling: a bare nats-py publisher process sending the
same token events (same coalescing) to plain subscribers here. Reported: tokens/s, and CPU
seconds per 10k tokens in the sending process and in this one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, Server, wait_for_worker
from mesh_app.bench.common import cpu_seconds, table, timed_stream
from protocol.codec import WireFormat, dump_token


async def _mesh_run(
    server: Server, tmp: Path, *, parts: int, streams: int, tokens: int, rounds: int
) -> dict[str, float]:
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
    try:
        async with Connection(settings.nats, "relay-probe") as conn:
            await wait_for_worker(conn, name)
        async with MeshClient(settings=settings) as client:

            async def burst() -> int:
                rows = await asyncio.gather(
                    *(
                        timed_stream(
                            client, "[tag:r] go", via="cloud", model=name, max_tokens=tokens
                        )
                        for _ in range(streams)
                    )
                )
                return sum(r.tokens for r in rows)

            await burst()  # warm
            cpu_w, cpu_c, began = cpu_seconds(worker.pid), cpu_seconds(), time.perf_counter()
            cpu_s = cpu_seconds(server.pid)
            moved = 0
            for _ in range(rounds):
                moved += await burst()
            wall = time.perf_counter() - began
            return {
                "tokens_per_s": moved / wall,
                "sender_cpu_per_10k": (cpu_seconds(worker.pid) - cpu_w) / moved * 10_000,
                "client_cpu_per_10k": (cpu_seconds() - cpu_c) / moved * 10_000,
                "server_cpu_per_10k": (cpu_seconds(server.pid) - cpu_s) / moved * 10_000,
            }
    finally:
        await worker.stop()


class _Counter:
    """Counts one round's tokens arriving on the bare subscriptions."""

    def __init__(self, expected: int) -> None:
        self.remaining = expected
        self.done = asyncio.Event()

    async def on_msg(self, msg: Any) -> None:
        self.remaining -= int(msg.headers["n"]) if msg.headers else 0
        if self.remaining <= 0:
            self.done.set()


async def _bare_run(
    server: Server, *, parts: int, streams: int, tokens: int, rounds: int
) -> dict[str, float]:
    nc = await nats.connect(server.url)
    moved, wall, cpu_c, cpu_p, cpu_s = 0, 0.0, 0.0, 0.0, 0.0
    try:
        for round_no in range(rounds + 1):
            counter = _Counter(streams * tokens)
            subs = [await nc.subscribe(f"bare.{i}", cb=counter.on_msg) for i in range(streams)]
            await nc.flush()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mesh_app.bench.relay",
                "--publish",
                server.url,
                str(parts),
                str(streams),
                str(tokens),
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                assert proc.stdout is not None
                await asyncio.wait_for(proc.stdout.readline(), 60)  # connected, waiting for "go"
                began, cpu_before = time.perf_counter(), cpu_seconds()
                server_before = cpu_seconds(server.pid)
                await nc.publish("bare.go", b"")
                await asyncio.wait_for(counter.done.wait(), 120)
                elapsed, client_cpu = time.perf_counter() - began, cpu_seconds() - cpu_before
                server_cpu = cpu_seconds(server.pid) - server_before
                sender_cpu, _stderr = await proc.communicate()  # it prints its CPU seconds
            finally:
                if proc.returncode is None:  # a failed round must not leave its sender behind
                    proc.kill()
                    await proc.wait()
            for sub in subs:
                await sub.unsubscribe()
            if round_no == 0:  # warm-up
                continue
            moved += streams * tokens
            wall += elapsed
            cpu_c += client_cpu
            cpu_p += float(sender_cpu)
            cpu_s += server_cpu
    finally:
        await nc.close()
    return {
        "tokens_per_s": moved / wall,
        "sender_cpu_per_10k": cpu_p / moved * 10_000,
        "client_cpu_per_10k": cpu_c / moved * 10_000,
        "server_cpu_per_10k": cpu_s / moved * 10_000,
    }


async def _publish(url: str, parts: int, streams: int, tokens: int) -> None:
    """The bare sender: the same token events the mesh sends, coalesced the same way."""
    nc = await nats.connect(url)
    go = asyncio.Event()

    async def on_go(_msg: Any) -> None:
        go.set()

    await nc.subscribe("bare.go", cb=on_go)
    await nc.flush()
    print("ready", flush=True)
    await go.wait()
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
    await nc.close()


async def run(*, streams: int = 4, tokens: int = 4000, rounds: int = 12) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="mesh-bench-relay-"))
    server = Server(tmp / "store")
    await server.start()
    results: dict[str, Any] = {"streams": streams, "tokens": tokens}
    try:
        for label, parts in (("coalescing on (16, 5 ms)", 16), ("coalescing off", 1)):
            shape = {"parts": parts, "streams": streams, "tokens": tokens, "rounds": rounds}
            results[f"mesh, {label}"] = await _mesh_run(server, tmp, **shape)
            results[f"bare nats-py, {label}"] = await _bare_run(server, **shape)
    finally:
        await server.stop()
    for label in ("coalescing on (16, 5 ms)", "coalescing off"):
        mesh, bare = results[f"mesh, {label}"], results[f"bare nats-py, {label}"]
        mesh["share_of_bare"] = mesh["tokens_per_s"] / bare["tokens_per_s"]
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
        "process (deterministic backend, no delays); CPU in ms per 10k tokens"
    )
    return (
        head
        + "\n"
        + table(["path", "tokens/s", "sender CPU", "client CPU", "server CPU", "of bare"], rows)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--publish", nargs=4, metavar=("URL", "PARTS", "STREAMS", "TOKENS"))
    args = parser.parse_args()
    url, parts, streams, tokens = args.publish
    asyncio.run(_publish(url, int(parts), int(streams), int(tokens)))
