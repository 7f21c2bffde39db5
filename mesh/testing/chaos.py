"""What the fault tests (tests/chaos) and the failover benchmark are made of: real processes,
a cuttable link, exact answers.

- :class:`MeshProcess`: a real ``mesh worker`` or ``mesh edge`` process on the deterministic
  backend; killed by its own PID only.
- :func:`paused`: SIGSTOP one process by its PID for a block, SIGCONT when the block ends: the
  process comes back with the state it had (a delivery it no longer holds, a lease since lost).
- :class:`mesh.testing.proxy.TcpProxy` (its own module): the cuttable link.
- :class:`Server`: a nats-server with file storage on a fixed port and store directory, so it
  can be restarted on the same port and store.
- :func:`ask` and :class:`Tally`: every answer is checked exactly against the deterministic
  script and counted as correct, typed (a typed error), lost (silence: only the client's own
  timeout ended it) or corrupt (an answer whose text is not the one asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors

from mesh.backends.deterministic import Script
from mesh.client import MeshClient
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from protocol.errors import MeshError, MeshTimeoutError
from protocol.messages import EndEvent, InferRequest, RestartEvent, TokenEvent
from protocol.subjects import edge_resend_subject


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- nats-server ---------------------------------------------------------------------------
class Server:
    """A JetStream nats-server with file storage that can go down and come back as it was."""

    def __init__(self, store_dir: Path) -> None:
        self.store_dir = store_dir
        self.port = free_port()
        self._server: NatsServer | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server else None

    async def start(self) -> None:
        self._server = NatsServer(port=self.port, store_dir=str(self.store_dir))
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()  # SIGTERM, as an operator would
            self._server = None

    async def restart(self, outage: float) -> None:
        await self.stop()
        await asyncio.sleep(outage)  # the outage itself is the fault being tested
        await self.start()


PORT_TRIES = 3
"""Starts of a cluster whose picked ports another process took meanwhile."""


class JsCluster:
    """A JetStream cluster of ``size`` nats-servers on loopback, with routes between them. Each
    node keeps its ports and store, so it can be killed by PID and started again as it was."""

    def __init__(self, tmp: Path, size: int = 3, name: str = "mesh") -> None:
        self.tmp = tmp
        self.name = name
        self.ports = {f"n{i + 1}": (free_port(), free_port()) for i in range(size)}
        self.servers: dict[str, NatsServer] = {}

    @property
    def url(self) -> str:
        """Every server's URL, comma-separated: what clients, workers and edges are given."""
        return ",".join(f"nats://127.0.0.1:{client}" for client, _route in self.ports.values())

    def _conf(self, node: str) -> Path:
        client, route = self.ports[node]
        routes = ", ".join(
            f"nats-route://127.0.0.1:{r}" for name, (_c, r) in self.ports.items() if name != node
        )
        path = self.tmp / f"{node}.conf"
        path.write_text(
            f"server_name: {node}\nlisten: 127.0.0.1:{client}\n"
            f'jetstream {{ store_dir: "{self.tmp / node}" }}\n'
            f"cluster {{ name: {self.name}\n listen: 127.0.0.1:{route}\n routes: [{routes}] }}\n"
            # Lame duck (a rolling restart's step): 30 s is nats-server's least duration; it
            # closes its few clients well before that and exits after the last one.
            "lame_duck_duration: 30s\nlame_duck_grace_period: 1s\n"
        )
        return path

    async def start(self, node: str | None = None) -> None:
        """Start every node (or one), concurrently: each waits for its peers' routes. At the
        first start, a port another process took since it was picked (``free_port`` only
        looked) is picked again, up to :data:`PORT_TRIES` times; a node started again keeps
        its own."""
        names = [node] if node else list(self.ports)
        first = node is None and not self.servers
        for tries in range(1, PORT_TRIES + 1):
            servers = {
                n: NatsServer(config=str(self._conf(n)), port=self.ports[n][0]) for n in names
            }
            started = await asyncio.gather(
                *(s.start() for s in servers.values()), return_exceptions=True
            )
            failed = [r for r in started if isinstance(r, BaseException)]
            if not failed:
                self.servers.update(servers)
                return
            for server in servers.values():
                await server.stop()
            taken = any("address already in use" in str(exc) for exc in failed)
            if not (first and taken) or tries == PORT_TRIES:
                raise failed[0]
            self.ports = {n: (free_port(), free_port()) for n in self.ports}

    async def lame_duck(self, node: str, timeout: float = 60.0) -> None:
        """Put ``node`` in lame duck mode by its PID (SIGUSR2, what ``nats-server --signal ldm``
        sends): it stops taking clients, moves them off and exits. Waits until it has."""
        server = self.servers.pop(node)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGUSR2)
        proc = server._proc
        if proc is not None:
            await asyncio.wait_for(proc.wait(), timeout)
        await server.stop()  # only tidies up: the process is gone

    async def kill(self, node: str) -> None:
        """kill -9 ``node`` by its PID."""
        server = self.servers.pop(node)
        await server.kill()
        await server.stop()  # only tidies up: the process is gone

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.servers.values()), return_exceptions=True)
        self.servers.clear()


# -- paused processes ----------------------------------------------------------------------
@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` (one process, by its PID) for the ``with`` block, and SIGCONT it when the
    block ends, however it ends. The connections stay open: nobody sees a disconnect."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# -- mesh processes ------------------------------------------------------------------------
@dataclass
class MeshProcess:
    """A ``mesh worker`` or ``mesh edge`` process; its log goes to ``log_path``."""

    role: str
    name: str
    env: dict[str, str]
    log_path: Path
    proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def start(self) -> MeshProcess:
        env = {**os.environ, **self.env, "MESH_LOG_FORMAT": "json", "MESH_LOG_LEVEL": "info"}
        log = self.log_path.open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mesh_app.cli",
            self.role,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        log.close()
        return self

    def kill(self) -> None:
        """kill -9, by PID."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # reaped, returncode not yet set
                os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # exited, reaped, returncode not yet set
            os.kill(self.proc.pid, signal.SIGTERM)
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused process acts on its SIGTERM
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.kill()
            await self.proc.wait()

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        return int(line.split()[1])

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(raw))
        return lines


def worker_env(url: str, node_id: str, *, slots: int = 4, token_ms: float = 20) -> dict[str, str]:
    return {
        "MESH_NATS_URL": url,
        "MESH_WORKER_NODE_ID": node_id,
        "MESH_WORKER_MODEL_BACKEND": "deterministic",
        "MESH_WORKER_MODEL_SLOTS": str(slots),
        "MESH_WORKER_MODEL_TOKEN_DELAY_MS": str(token_ms),
        "MESH_WORKER_MODEL_PREFILL_DELAY_MS": "20",
        "MESH_WORKER_DRAIN_GRACE": "2",
    }


def edge_env(url: str, edge_id: str, *, token_ms: float = 5) -> dict[str, str]:
    return {
        "MESH_NATS_URL": url,
        "MESH_EDGE_EDGE_ID": edge_id,
        "MESH_EDGE_MODEL_BACKEND": "deterministic",
        "MESH_EDGE_MODEL_FAULTS": "false",  # a local fallback answers, whatever the prompt says
        "MESH_EDGE_MODEL_SLOTS": "8",
        "MESH_EDGE_MODEL_TOKEN_DELAY_MS": str(token_ms),
        "MESH_EDGE_LOCAL_QUEUE": "64",
        "MESH_EDGE_HTTP_PORT": "-1",
        "MESH_EDGE_ROUTER_KIND": "heuristic",
    }


R3 = {"MESH_STREAM_REPLICAS": "3"}
"""Every hub stream on three servers of a JetStream cluster."""


async def start_r3_mesh(
    conn: Connection,
    url: str,
    edge_id: str,
    tmp: Path,
    procs: list[MeshProcess],
    *,
    slots: int,
) -> None:
    """Workers ``w1`` and ``w2`` and edge ``edge_id``, as processes on a 3-node hub with every
    stream R3; each is added to ``procs`` as it starts (the caller stops them), and each is
    waited for in the registry or as a micro service."""
    for node_id in ("w1", "w2"):
        env = {**worker_env(url, node_id, slots=slots, token_ms=20), **R3}
        log_path = tmp / f"{edge_id}-{node_id}.log"
        worker = await MeshProcess("worker", node_id, env, log_path).start()
        procs.append(worker)
        await wait_for_worker(conn, node_id, timeout=60, process=worker)
    env = {**edge_env(url, edge_id), **R3}
    procs.append(await MeshProcess("edge", edge_id, env, tmp / f"{edge_id}.log").start())
    await wait_for_edge(conn, edge_id, timeout=60)


async def wait_for_worker(
    conn: Connection, node_id: str, timeout: float = 30.0, process: MeshProcess | None = None
) -> None:
    """Until worker ``node_id`` is in the registry; fails at once when ``process`` (the worker's
    own) exits first, with the end of its log."""
    from mesh.registry import live_workers

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.proc is not None and process.proc.returncode is not None:
            tail = process.log_path.read_text(errors="replace")[-2000:]
            raise AssertionError(
                f"worker {node_id} exited ({process.proc.returncode}) before it announced "
                f"itself; its log ends:\n{tail}"
            )
        with contextlib.suppress(Exception):  # the worker creates the bucket: wait for it
            if any(info.node_id == node_id for info in await live_workers(conn)):
                return
        await asyncio.sleep(0.1)
    tail = process.log_path.read_text(errors="replace")[-3000:] if process is not None else ""
    raise AssertionError(
        f"worker {node_id} did not announce itself within {timeout:g}s"
        + (f"; its log ends:\n{tail}" if tail else "")
    )


async def wait_for_edge(conn: Connection, edge_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    probe = json.dumps({"id": "probe", "inbox": "_INBOX.probe.x"}).encode()
    while time.monotonic() < deadline:
        with contextlib.suppress(nats.errors.Error):
            await conn.nc.request(edge_resend_subject(edge_id), probe, timeout=1)
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"edge {edge_id} did not answer within {timeout:g}s")


# -- answers -------------------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # correct | typed | lost | corrupt
    detail: str = ""
    path: str = ""
    restarts: int = 0
    attempts: int = 1
    first_continued: float | None = None
    """When the first token of a later attempt arrived (``time.monotonic()``)."""
    elapsed: float = 0.0
    first_restarted: float | None = None
    """When the first token after a restart arrived (``time.monotonic()``)."""
    token_times: list[float] = field(default_factory=list)
    """When each token message arrived (``time.monotonic()``)."""

    @property
    def longest_silence(self) -> float | None:
        """The longest gap between two token messages, in seconds (None with fewer than two):
        how long the client's answer stood still."""
        gap = self._longest_gap()
        return None if gap is None else gap[0]

    @property
    def silence_began(self) -> float:
        """When the longest silence began (``time.monotonic()``; nan with fewer than two)."""
        gap = self._longest_gap()
        return float("nan") if gap is None else gap[1]

    def _longest_gap(self) -> tuple[float, float] | None:
        """The longest gap between two token messages and when it began."""
        return max(((b - a, a) for a, b in itertools.pairwise(self.token_times)), default=None)


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def add(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)

    def counts(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    def row(self, fault: str) -> str:
        c = self.counts()
        return (
            f"| {fault} | {len(self.outcomes)} | {c['correct']} | {c['typed']} | {c['lost']} "
            f"| {c['corrupt']} |"
        )

    def assert_sound(self) -> None:
        """The property: nothing lost, nothing corrupt."""
        bad = [o for o in self.outcomes if o.kind in ("lost", "corrupt")]
        assert not bad, f"{len(bad)} of {len(self.outcomes)} bad: {bad[:3]}"


def prompt(tag: str, *directives: str) -> str:
    return f"[tag:{tag}] {' '.join(directives)} Count for me."


def expected_text(tag: str, max_tokens: int) -> str:
    return Script(tag=tag).answer(max_tokens)


async def ask(
    client: MeshClient,
    tag: str,
    max_tokens: int,
    *directives: str,
    first_token: asyncio.Event | None = None,
    **kwargs: Any,
) -> Outcome:
    """One request through the SDK, checked exactly. ``first_token`` is set when the first token
    arrives, so a fault test can wait until its answers are under way."""
    began = time.monotonic()
    parts: list[str] = []
    restarts = 0
    attempts = 1
    first_continued: float | None = None
    first_restarted: float | None = None
    token_times: list[float] = []
    end: EndEvent | None = None
    try:
        async for event in client.stream(prompt(tag, *directives), max_tokens=max_tokens, **kwargs):
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                token_times.append(time.monotonic())
                if first_token is not None:
                    first_token.set()
                if restarts and first_restarted is None:
                    first_restarted = time.monotonic()
                if event.attempt > attempts:
                    attempts = event.attempt
                    first_continued = first_continued or time.monotonic()
            elif isinstance(event, RestartEvent):
                parts.clear()
                restarts += 1
            else:
                end = event
    except MeshTimeoutError as err:
        return Outcome("lost", f"silence: {err.message}", elapsed=time.monotonic() - began)
    except MeshError as err:
        return Outcome("typed", err.code.value, elapsed=time.monotonic() - began)
    elapsed = time.monotonic() - began
    text = "".join(parts)
    want = expected_text(tag, max_tokens)
    if end is None or text != want or end.usage.completion_tokens != max_tokens:
        return Outcome("corrupt", f"got {text[-60:]!r}, want ...{want[-60:]!r}", elapsed=elapsed)
    return Outcome(
        "correct",
        path=end.path,
        restarts=restarts,
        attempts=max(attempts, end.attempt),
        first_continued=first_continued,
        elapsed=elapsed,
        first_restarted=first_restarted,
        token_times=token_times,
    )


async def under_way(started: Sequence[asyncio.Event], timeout: float = 30) -> None:
    """Wait until every answer has its first token (the events given to ``ask``)."""
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout)


def assert_in_flight(pending: Sequence[asyncio.Future[Any]]) -> None:
    """Right before a fault: every answer is still streaming, so the fault strikes it mid-answer
    however slow the machine was to set the fault up."""
    ended = sum(future.done() for future in pending)
    assert not ended, f"{ended} of {len(pending)} answers ended before the fault: make them longer"


def request_for(tag: str, max_tokens: int, *directives: str, **fields: Any) -> InferRequest:
    return InferRequest(prompt=prompt(tag, *directives), max_tokens=max_tokens, **fields)
