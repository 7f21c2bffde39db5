"""Two versions of a worker (or of an edge) in one mesh, taking turns: CPU per token and per
request of each, beside a floor measured in the same run.

Run-to-run drift on a shared 2-core machine (10% and more) hides a change worth 5%; here both
versions see the same server, backend, load and minute. Version A is the code in ``--a-tree``
(a checkout of another commit: ``git worktree add /tmp/a <commit>``), version B this tree.

- ``--role worker``: worker A serves model ``model-a``, worker B the default model; the SDK
  streams via the cloud to each in turn. Floor: the bare relay (``mesh bench paths``).
- ``--role edge``: edge A (``edge-a``) and edge B in front of one worker; the SDK streams
  through each (route=cloud). Floor: the bare middle (``mesh bench paths``).

Each path runs ``--streams`` requests at once, at two answer lengths (``--lens``), round after
round in rotating order; CPU per token is the slope between the two lengths, the fixed part
what is left. Read one run with care: the same code on both sides (``--a-tree`` this tree)
read 0.84 and 1.09 here (worker, edge; 8 rounds), and pinning processes to cores did not
narrow it (1.13). Run it more than once. A development tool, not part of the mesh.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import MeshProcess, edge_env, wait_for_edge, wait_for_worker
from mesh_app.bench.common import bench_mesh, bench_worker_env, cpu_seconds, timed_stream
from mesh_app.bench.paths import MIDDLE_SUBJECT, _bare_relay, bare

PROMPT = "[tag:b] benchmark"


async def run(
    role: str, a_tree: str, streams: int, rounds: int, lens: tuple[int, int]
) -> dict[str, Any]:
    # Version A's modules come from its tree only: PYTHONSAFEPATH keeps the working directory
    # (this tree) off its path.
    tree = {"PYTHONPATH": a_tree, "PYTHONSAFEPATH": "1"}
    async with contextlib.AsyncExitStack() as stack:
        mesh = await stack.enter_async_context(
            bench_mesh(prefill_ms=50, token_ms=20, slots=streams)
        )
        url = mesh.server.url
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
        floor_pid = await stack.enter_async_context(_bare_relay("--bare", url, mesh.backend_url))
        if role == "edge":
            floor_pid = await stack.enter_async_context(_bare_relay("--middle", url))
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

        names = ("floor", "A", "B")
        for name in names:  # warm connections, consumers and caches
            for _ in range(3):
                await path(name)(8)
        spent = {(name, n): 0.0 for name in names for n in lens}
        for r in range(rounds):
            for tokens in lens:
                for name in names[r % 3 :] + names[: r % 3]:
                    before = cpu_seconds(pids[name])
                    await asyncio.gather(*(path(name)(tokens) for _ in range(streams)))
                    spent[(name, tokens)] += cpu_seconds(pids[name]) - before
    requests = rounds * streams
    out: dict[str, Any] = {"role": role, "streams": streams, "rounds": rounds, "lens": lens}
    for name in names:
        short, long = (spent[(name, n)] / requests for n in lens)
        per_token = (long - short) / (lens[1] - lens[0])
        out[name] = {
            "per_token_us": per_token * 1e6,
            "fixed_ms": (short - per_token * lens[0]) * 1e3,
            f"ms_per_request_at_{lens[1]}": long * 1e3,
        }
    return out


def render(out: dict[str, Any]) -> str:
    floor = "bare relay" if out["role"] == "worker" else "bare middle"
    rows = [
        f"{out['role']} A/B, {out['streams']} streams, {out['rounds']} rounds, "
        f"answers of {out['lens'][0]} and {out['lens'][1]} tokens (floor: the {floor})"
    ]
    for name in ("floor", "A", "B"):
        r = out[name]
        rows.append(
            f"{name:5}  CPU per token {r['per_token_us']:6.1f} us  fixed {r['fixed_ms']:6.3f} ms"
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
    parser.add_argument("--role", choices=("worker", "edge"), default="worker")
    parser.add_argument("--a-tree", required=True, help="checkout of version A")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--lens", default="32,128", help="two answer lengths, in tokens")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    short, long = (int(x) for x in args.lens.split(","))
    tree = str(Path(args.a_tree).resolve())
    out = asyncio.run(run(args.role, tree, args.streams, args.rounds, (short, long)))
    print(render(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
