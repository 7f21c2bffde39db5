"""``mesh bench failover``: how long a client's answer stands still when what serves it fails.

Real ``mesh worker`` and ``mesh edge`` processes on the deterministic engine (20 ms a token),
one nats-server, faults made by PID. Each fault gets fresh processes; every answer is checked
exactly. For each fault, the wait from the fault to the first token the client gets after it:

- **kill -9**: the worker generating the answers dies; another continues them, via the SDK
  straight to the queue and via an edge;
- **freeze**: the same worker stands still (SIGSTOP, 3 s) instead: another continues them, or
  they go on when it wakes;
- **SIGTERM**: the same worker is stopped, as a rolling restart stops each in turn: it hands its
  answers over (or drains them) while another has room;
- **fleet death**: every worker dies mid-answer; the edge answers locally (first local token);
- **fleet gone**: every worker dies, and requests are sent right after, while the registry still
  shows the dead worker (its ttl); the edge answers them locally (from the kill to the first
  local token);
- **engine hang**: the engine stops producing tokens mid-answer while the worker lives; the edge
  answers locally (after one answer via the cloud: the fault's time is reckoned from when the
  requests are sent, and a cold start's first answer came late enough, once in a run, to read
  0.07 s instead of 2.05);
- **the hub**, 3 nodes with R3 streams: the stream leader killed (an election), then every node
  restarted in turn in lame duck mode; for these, each answer's longest silence, and each
  answer that stood still :data:`STILL_S` or longer named (the step, the way it came).

``ack_wait`` is the default (5 s): the timer path stays the backstop, so a figure near 5 s
would mean the event path did not work.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.connection import Connection
from mesh.testing.chaos import (
    JsCluster,
    MeshProcess,
    Outcome,
    Server,
    ask,
    edge_env,
    paused,
    start_r3_mesh,
    wait_for_edge,
    wait_for_worker,
    worker_env,
)
from mesh_app.bench.common import bench_dir, pct, table

ROUNDS = 5
"""Faults of each kind; each round asks REQUESTS answers (half via an edge)."""
REQUESTS = 4
SDK_ASKS = REQUESTS // 2
"""Of a step's answers, the first this many are asked via the SDK (the cloud), the rest via an
edge (:func:`_asks`, :func:`via_of`)."""
TOKENS = 100
"""Per answer: 2 s at 20 ms a token; the fault lands 0.6 s in."""
FREEZE_S = 3.0
ON_THE_WIRE_S = 0.05
FAULTS = ("kill -9", "freeze", "SIGTERM", "fleet death", "fleet gone", "engine hang")
EDGE_ONLY = ("fleet death", "fleet gone", "engine hang")
"""Faults only an edge can answer for (locally): every ask goes via it."""
HUB_KILLS = 3
"""Stream-leader kills on the 3-node hub (each costs an election: 6 to 7 s here)."""
STILL_S = 0.1
"""A hub answer silent this long or longer is listed by name (a token comes every 20 ms)."""
HANG = "[hang-after:30]"
HANG_AFTER_S = 30 * 0.020 + 0.020
"""30 tokens at 20 ms after a 20 ms prefill: when the engine stops producing."""


class _Mesh:
    """One nats-server, an edge and workers, all processes, for one round."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server = Server(tmp / "store")
        self.processes: list[MeshProcess] = []
        self.conn: Connection | None = None
        self.client: MeshClient | None = None

    async def worker(self, name: str) -> MeshProcess:
        env = worker_env(self.server.url, name, slots=16)
        proc = await MeshProcess("worker", name, env, self.tmp / f"{name}.log").start()
        self.processes.append(proc)
        assert self.conn is not None
        await wait_for_worker(self.conn, name, process=proc)
        return proc


@contextlib.asynccontextmanager
async def _mesh(tmp: Path) -> AsyncIterator[_Mesh]:
    mesh = _Mesh(tmp)
    await mesh.server.start()
    settings = load_settings(
        {("nats", "url"): mesh.server.url, ("edge", "edge_id"): "bench"}, environ={}
    )
    try:
        async with (
            Connection(settings.nats, "bench") as conn,
            MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as client,
        ):
            mesh.conn, mesh.client = conn, client
            edge = MeshProcess("edge", "bench", edge_env(mesh.server.url, "bench"), tmp / "e.log")
            mesh.processes.append(await edge.start())
            await wait_for_edge(conn, "bench")
            yield mesh
    finally:
        await asyncio.gather(*(p.stop() for p in mesh.processes), return_exceptions=True)
        await mesh.server.stop()


def via_of(i: int) -> str:
    """Who asks a step's ``i``-th answer: ``sdk`` or ``edge``."""
    return "sdk" if i < SDK_ASKS else "edge"


def _asks(client: MeshClient, tag: str, *directives: str) -> list[asyncio.Future[Outcome]]:
    asks = [
        ask(client, f"{tag}c{i}", TOKENS, *directives, via="cloud")
        if via_of(i) == "sdk"
        else ask(client, f"{tag}e{i - SDK_ASKS}", TOKENS, *directives, via="edge", route="cloud")
        for i in range(REQUESTS)
    ]
    return [asyncio.ensure_future(a) for a in asks]


async def _round(tmp: Path, fault: str, n: int) -> tuple[list[Outcome], float, float | None]:
    """One fault; the outcomes, the loop time it struck, and how long a SIGTERM'd worker took
    to exit."""
    async with _mesh(tmp / f"{fault.replace(' ', '-')}{n}") as mesh:
        assert mesh.client is not None
        doomed = await mesh.worker(f"doomed{n}")
        if fault in ("engine hang", "fleet gone"):  # the edge sends to the cloud by then
            warm = await ask(mesh.client, f"{fault[0]}{n}w", 4, via="edge", route="cloud")
            if (warm.kind, warm.path) != ("correct", "cloud"):
                raise RuntimeError(f"the cloud did not answer before the fault: {warm}")
        if fault == "engine hang":  # only the edge can answer instead: every ask goes via it
            hung = [
                asyncio.ensure_future(
                    ask(mesh.client, f"h{n}e{i}", TOKENS, HANG, via="edge", route="cloud")
                )
                for i in range(REQUESTS)
            ]
            struck = time.monotonic() + HANG_AFTER_S  # about when the engine stops
            return list(await asyncio.gather(*hung)), struck, None
        if fault == "fleet gone":
            doomed.kill()
            struck = time.monotonic()
            after = [
                ask(mesh.client, f"g{n}e{i}", TOKENS, via="edge", route="cloud")
                for i in range(REQUESTS)
            ]
            return list(await asyncio.gather(*after)), struck, None
        pending: list[asyncio.Future[Outcome]]
        if fault == "fleet death":  # only the edge can answer instead: every ask goes via it
            pending = [
                asyncio.ensure_future(
                    ask(mesh.client, f"f{n}e{i}", TOKENS, via="edge", route="cloud")
                )
                for i in range(REQUESTS)
            ]
        else:
            pending = _asks(mesh.client, f"{fault[0]}{n}")
            await mesh.worker(f"survivor{n}")
        await asyncio.sleep(0.6)
        struck = time.monotonic()
        took = None
        if fault == "freeze":
            with paused(doomed.pid):
                await asyncio.sleep(FREEZE_S)
        elif fault == "SIGTERM":
            await doomed.stop()  # a rolling restart's step: it hands its answers over
            took = time.monotonic() - struck
        else:
            doomed.kill()
        return list(await asyncio.gather(*pending)), struck, took


async def _hub(tmp: Path, rounds: int) -> dict[str, Any]:
    """A 3-node hub (R3 streams) with two workers and an edge: the stream leader killed
    ``rounds`` times, then every node restarted in turn in lame duck mode, answers streaming
    through both. Each answer's longest silence, and the time to the first new answer after a
    kill (the election)."""
    cluster = JsCluster(tmp / "hub")
    (tmp / "hub").mkdir()
    await cluster.start()
    url = cluster.url
    settings = load_settings(
        {("nats", "url"): url, ("edge", "edge_id"): "benchhub", ("stream", "replicas"): 3},
        environ={},
    )
    processes: list[MeshProcess] = []
    silences: dict[str, list[float]] = {"leader kill": [], "hub lame duck": []}
    kinds: dict[str, dict[str, int]] = {fault: {} for fault in silences}
    elections: list[float] = []
    edge_during: list[dict[str, Any]] = []
    still: list[dict[str, Any]] = []
    try:
        async with (
            Connection(settings.nats, "bench") as conn,
            MeshClient(settings=settings, first_event_timeout=60, idle_timeout=60) as client,
        ):
            await start_r3_mesh(conn, url, "benchhub", tmp, processes, slots=16)
            steps = [("leader kill", None)] * rounds + [("hub lame duck", n) for n in cluster.ports]
            for n, (fault, node) in enumerate(steps):
                pending = _asks(client, f"h{n}")
                await asyncio.sleep(0.6)
                if node is None:
                    info = await conn.jsm().stream_info(settings.stream.name)
                    leader = info.cluster.leader if info.cluster else None
                    if leader is None:
                        continue
                    killed = time.monotonic()
                    await cluster.kill(leader)
                    # New work via an edge meanwhile: its own model, or the cloud if back.
                    during = await ask(client, f"e{n}", 1, via="edge", route="cloud")
                    edge_during.append({"s": during.elapsed, "path": during.path or during.kind})
                    for _probe in range(1200):  # a fresh answer, every 0.1 s, up to 2 min
                        if (await ask(client, f"p{n}", 1, via="cloud")).kind == "correct":
                            break
                        await asyncio.sleep(0.1)
                    elections.append(time.monotonic() - killed)
                    await cluster.start(leader)
                else:
                    await cluster.lame_duck(node)
                    await cluster.start(node)
                outcomes = await asyncio.gather(*pending)
                for outcome in outcomes:
                    kinds[fault][outcome.kind] = kinds[fault].get(outcome.kind, 0) + 1
                    if outcome.longest_silence is not None:
                        silences[fault].append(outcome.longest_silence)
                still += stood_still(outcomes, fault, n)
                await _caught_up(conn, settings.stream.name)
    finally:
        await asyncio.gather(*(p.stop() for p in processes), return_exceptions=True)
        await cluster.stop()
    return {
        fault: {
            "longest_silence": {
                "n": len(s),
                "p50_s": pct(s, 0.5) if s else None,
                "p99_s": pct(s, 0.99) if s else None,
                "max_s": max(s) if s else None,
            },
            "answers": kinds[fault],
        }
        for fault, s in silences.items()
    } | {"election_s": elections, "edge_during_election": edge_during, "stood_still": still}


def stood_still(outcomes: list[Outcome], fault: str, step: int) -> list[dict[str, Any]]:
    """The answers of one step (in :func:`_asks`' order) that stood still :data:`STILL_S` or
    longer: which, how long, and how many attempts it took."""
    return [
        {
            "fault": fault,
            "step": step,
            "via": via_of(i),
            "s": round(silence, 3),
            "attempts": outcome.attempts,
        }
        for i, outcome in enumerate(outcomes)
        if (silence := outcome.longest_silence) is not None and silence >= STILL_S
    ]


async def _caught_up(conn: Connection, stream: str, timeout: float = 120.0) -> None:
    """Until the stream has a leader and two current followers again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            group = (await conn.jsm().stream_info(stream)).cluster
            peers = (group.replicas if group else None) or []
            if group and group.leader and len(peers) == 2 and all(p.current for p in peers):
                return
        await asyncio.sleep(0.25)


def _wait(outcome: Outcome, struck: float) -> float | None:
    """Fault -> the first token the client got after it: of the continued attempt, of the local
    restart, or of the same attempt once its worker woke. Tokens within ON_THE_WIRE_S of the
    fault left before it."""
    after = [t for t in outcome.token_times if t > struck + ON_THE_WIRE_S]
    return after[0] - struck if after else None


async def run(rounds: int = ROUNDS) -> dict[str, Any]:
    tmp = bench_dir("bench-failover-")
    results: dict[str, Any] = {"rounds": rounds, "requests": REQUESTS, "tokens": TOKENS}
    for fault in FAULTS:
        waits: dict[str, list[float]] = {"sdk": [], "edge": []}
        kinds: dict[str, int] = {}
        stops: list[float] = []
        for n in range(rounds):
            outcomes, struck, took = await _round(tmp, fault, n)
            if took is not None:
                stops.append(took)
            for i, outcome in enumerate(outcomes):
                kinds[outcome.kind] = kinds.get(outcome.kind, 0) + 1
                wait = _wait(outcome, struck)
                alone = fault in EDGE_ONLY
                via = "edge" if alone else via_of(i)
                if wait is not None:
                    waits[via].append(wait)
        results[fault] = {
            via: {
                "n": len(w),
                "p50_s": pct(w, 0.5) if w else None,
                "p99_s": pct(w, 0.99) if w else None,
                "max_s": max(w) if w else None,
            }
            for via, w in waits.items()
            if w or fault not in EDGE_ONLY
        }
        results[fault]["answers"] = kinds
        if stops:
            results[fault]["worker_exit_s"] = {"p50": pct(stops, 0.5), "max": max(stops)}
    results["hub"] = await _hub(tmp, rounds=min(rounds, HUB_KILLS))
    return results


def render(results: dict[str, Any]) -> str:
    rows = []
    for fault in FAULTS:
        entry = results.get(fault, {})
        kinds = entry.get("answers", {})
        checked = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        for via in ("sdk", "edge"):
            row = entry.get(via)
            if row is None:
                continue
            rows.append([fault, via, row["n"], row["p50_s"], row["p99_s"], row["max_s"], checked])
    text = "failover: fault -> first token after it (continued, or local), seconds\n"
    text += table(["fault", "via", "n", "p50", "p99", "max", "answers"], rows)
    exits = results.get("SIGTERM", {}).get("worker_exit_s")
    if exits:
        p50, worst = exits["p50"], exits["max"]
        text += f"\nSIGTERM: the worker exited in {p50:.2f} s p50, {worst:.2f} s max"
    hub = results.get("hub")
    if hub:
        rows = []
        for fault in ("leader kill", "hub lame duck"):
            entry = hub.get(fault, {})
            row = entry.get("longest_silence", {})
            checked = ", ".join(f"{k} {v}" for k, v in sorted(entry.get("answers", {}).items()))
            rows.append(
                [fault, row.get("n"), row.get("p50_s"), row.get("p99_s"), row.get("max_s"), checked]
            )
        text += "\n\n3-node hub: each answer's longest silence, seconds (SDK and edge together)\n"
        text += table(["fault", "n", "p50", "p99", "max", "answers"], rows)
        elections = hub.get("election_s") or []
        if elections:
            text += (
                "\nleader kill: the first new answer after "
                + ", ".join(f"{e:.2f}" for e in elections)
                + " s (nats-server's election)"
            )
        during = hub.get("edge_during_election") or []
        if during:
            text += "\nleader kill: new work via an edge meanwhile answered in " + ", ".join(
                f"{d['s']:.3f} s ({d['path']})" for d in during
            )
        still = hub.get("stood_still")
        if still is not None:
            text += f"\nstood still {STILL_S:g} s or longer: " + (
                ", ".join(
                    f"{e['fault']} (step {e['step']}) via {e['via']} {e['s']:.2f} s, "
                    f"{e['attempts']} attempt(s)"
                    for e in still
                )
                or "none"
            )
    return text
