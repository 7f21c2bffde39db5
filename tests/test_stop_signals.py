"""How `mesh worker` and `mesh edge` take SIGTERM while they start and while they stop.

- Asked while a worker of two models is still starting (its second model's engine does not
  answer its start yet, ``worker.also_serve``, while the first model's worker already serves),
  it leaves that start, lets the serving worker finish what it took, and exits 0. Before, the
  signal's default action ended the process at once (exit -15), mid-answer.
- Asked while a start waits on a JetStream that does not answer yet, the start ends there
  (exit 0 at once), not when its tries run out (3 s, then exit 1).
- Asked again while the ordered stop runs, the process ends at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from aiohttp import web

from mesh.backends.deterministic import Script
from mesh.client import MeshClient
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.status import collect_status
from mesh.testing.chaos import MeshProcess, edge_env, wait_for_worker, worker_env
from mesh.testing.openai_server import DeterministicServer
from protocol.messages import EndEvent, RestartEvent, TokenEvent
from tests.helpers import eventually

TOKENS = 40


class SecondStartHangs(DeterministicServer):
    """The engine answers its first ``/v1/models`` (the first worker's start) and holds every
    later one (the second model's start) until released."""

    def __init__(self) -> None:
        super().__init__("smollm2", prefill_ms=20, token_ms=40)
        self.models_asked = 0
        self.release = asyncio.Event()

    async def models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        if self.models_asked > 1:
            await self.release.wait()
        return await super().models(request)


async def test_a_stop_asked_while_a_second_engine_starts_lets_the_first_finish(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    engine = SecondStartHangs()
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    env = {
        "MESH_NATS_URL": settings.nats.url or "",
        "MESH_WORKER_NODE_ID": "starting",
        "MESH_WORKER_MODEL_BACKEND": "openai",
        "MESH_WORKER_MODEL_BASE_URL": f"http://127.0.0.1:{port}/v1",
        "MESH_WORKER_MODEL_SLOTS": "2",
        "MESH_WORKER_ALSO_SERVE": '["second"]',
        "MESH_WORKER_DRAIN_GRACE": "10",
    }
    proc = await MeshProcess("worker", "starting", env, tmp_path / "worker.log").start()
    events: list[object] = []
    try:

        async def first_serves_second_starts() -> bool:
            status = await collect_status(conn, settings)
            pool = status["pools"].get("smollm2") or {}
            return pool.get("workers") == 1 and engine.models_asked >= 2

        await eventually(
            first_serves_second_starts, timeout=20, what="the first worker up, the second starting"
        )
        async with MeshClient(
            settings=settings, connection=conn, first_event_timeout=10, idle_timeout=10
        ) as sdk:
            asked_at = 0.0
            async for event in sdk.stream("[tag:st] count", via="cloud", max_tokens=TOKENS):
                events.append(event)
                if isinstance(event, TokenEvent) and not asked_at:
                    os.kill(proc.pid, signal.SIGTERM)  # by PID, as the answer streams
                    asked_at = time.monotonic()
        assert proc.proc is not None
        code = await asyncio.wait_for(proc.proc.wait(), 15)
        stopped_in = time.monotonic() - asked_at
    finally:
        engine.release.set()
        await proc.stop()
        await runner.cleanup()
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert not [e for e in events if isinstance(e, RestartEvent)]
    assert text == Script(tag="st").answer(TOKENS)
    end = events[-1]
    assert isinstance(end, EndEvent) and end.served_by == "cloud:starting"
    assert code == 0, f"exit {code}: not an ordered stop"
    # The answer's 1.6 s, then the ordered stop; not the 30 s the held start could take.
    assert stopped_in < 8, f"stopped {stopped_in:.1f} s after the signal"


async def test_a_second_signal_during_the_ordered_stop_ends_the_process_at_once(
    settings: MeshSettings, conn: Connection, tmp_path: Path
) -> None:
    env = {**worker_env(settings.nats.url or "", "patient", token_ms=50)}
    env["MESH_WORKER_DRAIN_GRACE"] = "30"  # the answer in flight would hold the stop that long
    proc = await MeshProcess("worker", "patient", env, tmp_path / "worker.log").start()
    try:
        await wait_for_worker(conn, "patient", process=proc)
        async with MeshClient(settings=settings, connection=conn) as sdk:
            stream = sdk.stream("[tag:p] count", via="cloud", max_tokens=400)  # 20 s of tokens
            async for event in stream:
                if isinstance(event, TokenEvent):
                    break
            os.kill(proc.pid, signal.SIGTERM)

            async def stopping() -> bool:
                return any("signal again" in line.get("event", "") for line in proc.log_lines())

            await eventually(stopping, timeout=10, what="the worker to begin its ordered stop")
            assert proc.proc is not None and proc.proc.returncode is None  # it drains
            os.kill(proc.pid, signal.SIGTERM)
            asked_again = time.monotonic()
            code = await asyncio.wait_for(proc.proc.wait(), 10)
            took = time.monotonic() - asked_again
            await stream.aclose()
    finally:
        await proc.stop()
    assert code == -signal.SIGTERM
    assert took < 2, f"exited {took:.1f} s after the second signal"


@pytest.mark.parametrize("role", ["worker", "edge"])
async def test_a_stop_asked_while_the_start_waits_on_jetstream_ends_it_at_once(
    role: str, server_without_jetstream: NatsServer, tmp_path: Path
) -> None:
    """A worker provisioning the hub, or an edge its site's streams, where JetStream does not
    answer yet asks again for seconds (``mesh.provision.provisioned``); a stop asked meanwhile
    ends the start there (nothing was taken yet), not once the tries run out."""
    server = server_without_jetstream
    if role == "worker":
        env = worker_env(server.url, "early")
    else:
        env = {**edge_env(server.url, "early"), "MESH_NATS_HUB_DOMAIN": "hub"}
    proc = await MeshProcess(role, "early", env, tmp_path / f"{role}.log").start()
    try:

        async def retrying() -> bool:
            return any("provisioning slow" in line.get("event", "") for line in proc.log_lines())

        await eventually(retrying, timeout=20, what=f"the {role} to retry its provisioning")
        os.kill(proc.pid, signal.SIGTERM)
        asked = time.monotonic()
        assert proc.proc is not None
        code = await asyncio.wait_for(proc.proc.wait(), 15)
        took = time.monotonic() - asked
    finally:
        await proc.stop()
    assert code == 0, f"exit {code}"
    assert took < 1, f"exited {took:.2f} s after the signal (the tries take 3 s)"
