"""Two versions of a worker, an edge or the SDK in one mesh, taking turns: CPU per token and per
request of each, beside a floor measured in the same run.

Run-to-run drift on a shared 2-core machine (10% and more) hides a change worth 5%; here both
versions see the same server, backend, load and minute. Version A is the code in ``--a-tree``
(a checkout of another commit: ``git worktree add /tmp/a <commit>``), version B this tree.

- ``--role worker``: worker A serves model ``model-a``, worker B the default model; the SDK
  streams via the cloud to each in turn. Floor: the bare relay (``mesh bench paths``).
- ``--role edge``: edge A (``edge-a``) and edge B in front of one worker; the SDK streams
  through each (route=cloud). Floor: the bare middle (``mesh bench paths``).
- ``--role sdk``: SDK A and SDK B, each in a client process of its own, stream via the cloud
  to one worker. Floor: a bare nats-py reader of the bare relay, in a third client process.

Each path runs ``--streams`` requests at once, at two answer lengths (``--lens``), round after
round in rotating order; CPU per token is the slope between the two lengths, the fixed part
what is left. Beside the CPU it prints each side's wakeups a token (voluntary context switches,
the same split: a count the machine's load does not distort) and its time to first token at the
client (p50 and p99 over every request of the run; the worker and edge roles). ``--token-ms``
sets the backend's time between tokens, ``--lockstep`` puts every answer's tokens on one clock.
Read one run with care: the same code on both sides (``--a-tree`` this tree) read 0.84 and
1.09 here (worker, edge; 8 rounds), and pinning processes to cores did not narrow it (1.13).
Run it more than once.

Compare time to first token only with the sides swapped too (run this script from the other
tree, with ``--a-tree`` this one): a side's TTFT depends on its letter, whichever code runs there.
In the worker role B's p99 read 9 to 32 ms above A's in nine runs (12 and 16 rounds; old or new
code as B); in the edge role 11 to 35 ms below in five, and B's p50 0 to 2 ms below. Taking
turns in all six orders instead of three rotations did not change it (B +29 and +19 ms), and
the bench's other processes (the idle edge, the server) spent the same CPU in either side's
turns. The cause is not found. CPU per token can lean too: in the edge role B read 1.16 and 1.17
times A with the newer code as B, and 1.17 with it as A (three runs on one day). A development
tool, not part of the mesh.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, edge_env, wait_for_edge, wait_for_worker
from mesh_app.bench.bare import MIDDLE_SUBJECT, bare, bare_process
from mesh_app.bench.common import (
    Timed,
    bench_mesh,
    bench_worker_env,
    cpu_seconds,
    pct,
    split_by_length,
    timed_stream,
    wakeups,
)

PROMPT = "[tag:b] benchmark"
HERE = str(Path(__file__).resolve().parents[1])
"""This tree (version B)."""


def _from_tree(tree: str) -> dict[str, str]:
    """The environment that makes a Python process import the mesh from ``tree`` only
    (PYTHONSAFEPATH keeps the working directory off its path)."""
    return {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}


class ClientProcess:
    """A client of the mesh in a process of its own (``ab_bench.py --client URL PATH``), from
    the tree on its ``PYTHONPATH``: told a length, it runs one round and says it is done."""

    def __init__(self, url: str, path: str, env: dict[str, str]) -> None:
        self.args = (sys.executable, __file__, "--client", url, path)
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> int:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **self.env},
        )
        await self.round(8)  # connected, and warm
        return self.proc.pid

    async def round(self, tokens: int, streams: int = 3) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(f"{tokens} {streams}\n".encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
        if line.strip() != b"done":
            raise RuntimeError(f"client {self.args[-1]} failed: {line!r}")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def serve_client(url: str, path: str) -> None:
    """The client process: one round per line on stdin (``TOKENS STREAMS``)."""
    settings = load_settings({("nats", "url"): url, ("edge", "edge_id"): "bench"}, environ={})
    async with MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as client:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            tokens, streams = (int(x) for x in line.split())
            if path == "bare":
                runs = [bare(client.conn.nc, PROMPT, tokens) for _ in range(streams)]
            else:
                runs = [
                    timed_stream(client, PROMPT, via="cloud", max_tokens=tokens)
                    for _ in range(streams)
                ]
            await asyncio.gather(*runs)
            print("done", flush=True)


async def run(  # noqa: PLR0917 - the command line's options
    role: str,
    a_tree: str,
    streams: int,
    rounds: int,
    lens: tuple[int, int],
    token_ms: float,
    lockstep: bool = False,
) -> dict[str, Any]:
    tree = _from_tree(a_tree)
    async with contextlib.AsyncExitStack() as stack:
        mesh = await stack.enter_async_context(
            bench_mesh(prefill_ms=50, token_ms=token_ms, slots=streams, lockstep=lockstep)
        )
        url = mesh.server.url
        if role == "sdk":
            here = _from_tree(HERE)
            clients = {
                "floor": ClientProcess(url, "bare", here),
                "A": ClientProcess(url, "cloud", tree),
                "B": ClientProcess(url, "cloud", here),
            }
            await stack.enter_async_context(bare_process("--bare", url, mesh.backend_url))
            for c in clients.values():
                stack.push_async_callback(c.stop)
            pids = {name: await c.start() for name, c in clients.items()}
            return await _rounds(
                pids, lambda name: lambda t: clients[name].round(t, streams), streams, rounds, lens
            ) | {"role": role, "token_ms": token_ms}
        if role == "worker":
            env = {
                **bench_worker_env(url, mesh.backend_url, streams, "bench-worker-a"),
                "MESH_WORKER_MODEL_NAME": "model-a",
                **tree,
            }
            other = MeshProcess("worker", "bench-worker-a", env, Path("/dev/null"))
        else:
            env = {**edge_env(url, "edge-a"), "MESH_LOG_LEVEL": "warning", **tree}
            other = MeshProcess("edge", "edge-a", env, Path("/dev/null"))
        await other.start()
        stack.push_async_callback(other.stop)
        async with Connection(mesh.settings.nats, "ab-probe") as conn:
            if role == "worker":
                await wait_for_worker(conn, "bench-worker-a", process=other)
            else:
                await wait_for_edge(conn, "edge-a")
        floor_pid = await stack.enter_async_context(bare_process("--bare", url, mesh.backend_url))
        if role == "edge":
            floor_pid = await stack.enter_async_context(bare_process("--middle", url))
        client = await stack.enter_async_context(
            MeshClient(settings=mesh.settings, first_event_timeout=60, idle_timeout=60)
        )
        client_a = client
        if role == "edge":
            settings_a = load_settings(
                {("nats", "url"): url, ("edge", "edge_id"): "edge-a"}, environ={}
            )
            client_a = await stack.enter_async_context(
                MeshClient(settings=settings_a, first_event_timeout=60, idle_timeout=60)
            )
        mine = mesh.worker if role == "worker" else mesh.edge
        pids = {"floor": floor_pid, "A": other.pid, "B": mine.pid}
        nc = client.conn.nc

        def path(name: str) -> Callable[[int], Awaitable[Any]]:
            if name == "floor":
                subject = MIDDLE_SUBJECT if role == "edge" else "bench.bare.request"
                return lambda tokens: bare(nc, PROMPT, tokens, subject)
            if role == "worker":
                model = "model-a" if name == "A" else None
                return lambda tokens: timed_stream(
                    client, PROMPT, via="cloud", max_tokens=tokens, model=model
                )
            sdk = client_a if name == "A" else client
            return lambda tokens: timed_stream(sdk, PROMPT, route="cloud", max_tokens=tokens)

        for name in pids:  # warm connections, consumers and caches
            for _ in range(3):
                await path(name)(8)

        def together(name: str) -> Callable[[int], Awaitable[Any]]:
            return lambda tokens: asyncio.gather(*(path(name)(tokens) for _ in range(streams)))

        out = await _rounds(pids, together, streams, rounds, lens)
        return out | {"role": role, "token_ms": token_ms}


async def _rounds(
    pids: dict[str, int],
    together: Callable[[str], Callable[[int], Awaitable[Any]]],
    streams: int,
    rounds: int,
    lens: tuple[int, int],
) -> dict[str, Any]:
    """Each of floor, A and B in turn (rotating), ``streams`` requests at once, at each length;
    CPU per token (the slope between the lengths) and the fixed part of each process."""
    names = ("floor", "A", "B")
    spent = {(name, n): 0.0 for name in names for n in lens}
    woke = {(name, n): 0 for name in names for n in lens}
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for tokens in lens:
            for name in names[r % 3 :] + names[: r % 3]:
                before, slept = cpu_seconds(pids[name]), wakeups(pids[name])
                timed = await together(name)(tokens)
                spent[(name, tokens)] += cpu_seconds(pids[name]) - before
                woke[(name, tokens)] += wakeups(pids[name]) - slept
                ttfts[name] += [t.ttft * 1000 for t in timed or [] if isinstance(t, Timed)]
    requests = rounds * streams
    out: dict[str, Any] = {"streams": streams, "rounds": rounds, "lens": lens}
    for name in names:
        short, long = (spent[(name, n)] / requests for n in lens)
        per_token, fixed = split_by_length(short, long, *lens)
        w_short, w_long = (woke[(name, n)] / requests for n in lens)
        out[name] = {
            "per_token_us": per_token * 1e6,
            "fixed_ms": fixed * 1e3,
            "wakeups_per_token": split_by_length(w_short, w_long, *lens)[0],
            f"ms_per_request_at_{lens[1]}": long * 1e3,
        }
        if ttfts[name]:  # the clients' time to first token (not measured by a client process)
            out[name]["ttft_ms"] = {"p50": pct(ttfts[name], 0.5), "p99": pct(ttfts[name], 0.99)}
    return out


def render(out: dict[str, Any]) -> str:
    floor = {"worker": "bare relay", "edge": "bare middle", "sdk": "bare reader"}[out["role"]]
    rows = [
        f"{out['role']} A/B, {out['streams']} streams, {out['rounds']} rounds, "
        f"answers of {out['lens'][0]} and {out['lens'][1]} tokens (floor: the {floor})"
    ]
    for name in ("floor", "A", "B"):
        r = out[name]
        ttft = r.get("ttft_ms")
        rows.append(
            f"{name:5}  CPU per token {r['per_token_us']:6.1f} us  fixed {r['fixed_ms']:6.3f} ms"
            f"  wakeups per token {r['wakeups_per_token']:5.3f}"
            + (f"  TTFT p50 {ttft['p50']:6.2f} p99 {ttft['p99']:6.2f} ms" if ttft else "")
        )
    fa, fb, ff = out["A"]["per_token_us"], out["B"]["per_token_us"], out["floor"]["per_token_us"]
    rows.append(
        f"per token: A {_ratio(fa, ff)}x the floor, B {_ratio(fb, ff)}x; B/A {_ratio(fb, fa)}"
    )
    return "\n".join(rows)


def _ratio(a: float, b: float) -> str:
    """``a / b``, or n/a where ``b`` read no CPU at all (/proc's ticks are 10 ms)."""
    return f"{a / b:.2f}" if b > 0 else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if sys.argv[1:2] == ["--client"]:
        asyncio.run(serve_client(sys.argv[2], sys.argv[3]))
        return
    parser.add_argument("--role", choices=("worker", "edge", "sdk"), default="worker")
    parser.add_argument("--a-tree", required=True, help="checkout of version A")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--lens", default="32,128", help="two answer lengths, in tokens")
    parser.add_argument("--token-ms", type=float, default=20, help="the backend's time a token")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="every answer's tokens on one clock (an engine's steps)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    short, long = (int(x) for x in args.lens.split(","))
    tree = str(Path(args.a_tree).resolve())
    out = asyncio.run(
        run(args.role, tree, args.streams, args.rounds, (short, long), args.token_ms, args.lockstep)
    )
    print(render(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
