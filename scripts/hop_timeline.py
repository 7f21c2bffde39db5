"""Where a lone request's time to first token goes, hop by hop.

A development tool, not part of the mesh. ``mesh bench paths`` gives each path's time to first
token over calling the engine directly; this splits it. It runs the same paths one request at a
time (short answers, the deterministic OpenAI-compatible backend) with every Python process
writing a timestamp at each socket write and read and at each NATS message it parses
(``scripts/hop_probe/sitecustomize.py``, first on the children's ``PYTHONPATH``;
CLOCK_MONOTONIC is one clock for all of them), then reads for each request:

- ``to engine``: from the client's request leaving its process to the engine's request (the
  HTTP POST) leaving whoever calls the engine (the bare relay, the worker);
- ``back``: from the engine's first token leaving the backend to the client's read of it;
- ``added``: the two together, what the path adds to the engine's own time to first token;
- for each process on the way, ``in``: from the request's message parsed to that process's next
  write, wall time and the thread's CPU time (equal when nothing else runs meanwhile), and
  ``tok``: from its read of the first token to its next write.

The probes cost each process a few microseconds an event: compare paths within one run.

    python scripts/hop_timeline.py --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).resolve().parent / "hop_probe"
STARTS = (  # what the client's request write carries, by path (the bench's own process)
    ("mesh.v1.edge.", "via edge"),
    ("mesh.v1.infer.", "via cloud"),
    ("bench.middle.queued", "bare queued middle"),
    ("bench.middle.request", "bare middle"),
    ("bench.queue.request", "bare queue"),
    ("bench.bare.request", "bare relay"),
    ("POST /v1/", "direct"),
)
ROLES = ("edge", "bare middle", "worker", "bare relay")
"""The processes a request may cross before the engine, in the order they are reported."""
ON_PATH = {
    "direct": (),
    "bare relay": ("bare relay",),
    "bare queue": ("bare relay",),
    "bare middle": ("bare middle", "bare relay"),
    "bare queued middle": ("bare middle", "bare relay"),
    "via cloud": ("worker",),
    "via edge": ("edge", "worker"),
}
"""The processes each path's requests cross: another's reads and writes within a request's
window (an idle worker's ping, a pull's heartbeat) are none of its hops."""


@dataclass(frozen=True)
class Event:
    at: float
    cpu: float
    role: str
    kind: str  # wr, rd or got
    text: str


@dataclass
class Figures:
    """Each measure's values (ms) over the requests of one path."""

    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, name: str, value: float) -> None:
        self.values[name].append(value * 1000)

    def medians(self) -> dict[str, float]:
        return {name: round(statistics.median(v), 3) for name, v in self.values.items()}


def _role(command: str) -> str:
    if "--child" in command:
        return "bench"
    if " worker" in command:
        return "worker"
    if " edge" in command:
        return "edge"
    if "--bare " in command:
        return "bare relay"
    if "--middle " in command:
        return "bare middle"
    if "--prefill-ms" in command or "openai_server" in command:
        return "backend"
    return "bench"


def read_events(folder: Path) -> list[Event]:
    events = []
    for path in folder.glob("*.txt"):
        lines = path.read_text(encoding="latin-1").splitlines()
        if not lines:
            continue
        role = _role(lines[0])
        for line in lines[1:]:
            parts = line.split(" ", 3)
            if line.startswith("#") or len(parts) < 3:
                continue
            text = parts[3] if len(parts) > 3 else ""
            events.append(Event(float(parts[0]), float(parts[1]), role, parts[2], text))
    events.sort(key=lambda e: e.at)
    return events


def _start_of(event: Event) -> str | None:
    if event.role != "bench" or event.kind != "wr":
        return None
    for mark, path in STARTS:
        if mark in event.text:
            return path
    return None


def split(events: list[Event]) -> dict[str, Figures]:
    """Each path's figures, request by request (each begins at the bench's request write)."""
    starts = [(i, path) for i, e in enumerate(events) if (path := _start_of(e)) is not None]
    out: dict[str, Figures] = defaultdict(Figures)
    for n, (i, path) in enumerate(starts):
        end = starts[n + 1][0] if n + 1 < len(starts) else len(events)
        _one(events[i:end], path, out[path])
    return dict(out)


def _first(events: list[Event], after: float, test: object) -> Event | None:
    return next((e for e in events if e.at >= after and test(e)), None)  # type: ignore[operator]


def _one(events: list[Event], path: str, figures: Figures) -> None:
    t0 = events[0]
    if path == "direct":
        post = t0
    else:
        post = _first(events, t0.at, lambda e: e.kind == "wr" and "POST /v1/" in e.text)
    if post is None:
        return
    data = _first(events, post.at, lambda e: e.role == "backend" and "data:" in e.text)
    if data is None:
        return
    kind = "rd" if path == "direct" else "got"
    token = _first(events, data.at, lambda e: e.role == "bench" and e.kind == kind)
    if token is None:
        return
    figures.add("to engine", post.at - t0.at)
    figures.add("back", token.at - data.at)
    figures.add("added", post.at - t0.at + token.at - data.at)
    for role in ON_PATH[path]:
        got = _first(events, t0.at, lambda e, r=role: e.role == r and e.kind == "got")
        if got is not None and got.at < post.at:
            out = _first(events, got.at, lambda e, r=role: e.role == r and e.kind == "wr")
            # A hop on the request's way writes before (or as) the engine's request is written:
            # a message the process got meanwhile and answered later (a pull's heartbeat, then
            # its next pull) is none of this request's.
            if out is not None and out.at <= post.at:
                figures.add(f"{role} in", out.at - got.at)
                figures.add(f"{role} in, cpu", out.cpu - got.cpu)
        read = _first(events, data.at, lambda e, r=role: e.role == r and e.kind == "rd")
        if read is not None and read.at < token.at:
            out = _first(events, read.at, lambda e, r=role: e.role == r and e.kind == "wr")
            if out is not None and out.at < token.at:
                figures.add(f"{role} tok", out.at - read.at)


def _bench(rounds: int, tokens: int, prefill_ms: float) -> None:
    """In the probed child: the paths, one request at a time."""
    sys.path.insert(0, str(ROOT))
    from mesh_app.bench import paths

    asyncio.run(paths.run(concurrency=(1,), rounds=rounds, tokens=tokens, prefill_ms=prefill_ms))


def run(rounds: int, tokens: int, prefill_ms: float) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="hops-") as folder:
        env = {
            **os.environ,
            "MESH_HOP_PROBE_DIR": folder,
            "PYTHONPATH": os.pathsep.join(
                [str(PROBE), str(ROOT), os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep),
        }
        args = [sys.executable, __file__, "--child", "--rounds", str(rounds)]
        args += ["--tokens", str(tokens), "--prefill-ms", str(prefill_ms)]
        subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
        figures = split(read_events(Path(folder)))
    return {path: f.medians() | {"requests": len(f.values["added"])} for path, f in figures.items()}


def render(results: dict[str, dict[str, float]]) -> str:
    order = [p for _m, p in STARTS[::-1] if p in results]
    rows = [f"{'path':20} {'requests':>8} {'to engine':>10} {'back':>8} {'added':>8}   hops (ms)"]
    for path in order:
        r = results[path]
        hops = "; ".join(
            f"{role} in {r[f'{role} in']:.3f} (cpu {r[f'{role} in, cpu']:.3f})"
            + (f", tok {r[f'{role} tok']:.3f}" if f"{role} tok" in r else "")
            for role in ROLES
            if f"{role} in" in r
        )
        rows.append(
            f"{path:20} {r['requests']:>8} {r['to engine']:>10.3f} {r['back']:>8.3f} "
            f"{r['added']:>8.3f}   {hops}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="requests per path (default 20)")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--prefill-ms", type=float, default=50.0)
    parser.add_argument("--json", help="also write the medians to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _bench(args.rounds, args.tokens, args.prefill_ms)
        return
    results = run(args.rounds, args.tokens, args.prefill_ms)
    print("medians over the requests, ms (one request at a time)")
    print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
