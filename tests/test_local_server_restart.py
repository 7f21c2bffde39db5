"""``mesh up`` starts its nats-server again when the server's process ends by nobody's stop (a
crash, the OOM killer, a stray kill): on its port and its store, so the nodes reconnect and
what JetStream kept is there again. Before, ``mesh up`` ran on with no server for good: every
request failed and ``/ready`` said 503 until someone restarted it by hand."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mesh.client import MeshClient
from mesh.config import load_settings
from mesh.testing.chaos import expected_text
from mesh_app.local import LocalMesh
from tests.helpers import eventually, holds


async def test_mesh_up_starts_its_killed_nats_server_again(tmp_path: object) -> None:
    settings = load_settings(environ={})
    settings.nats.local_port = -1  # a free port, kept across the restart
    settings.nats.store_dir = str(tmp_path)
    settings.worker.model.backend = "deterministic"
    settings.edge.model.backend = "deterministic"
    settings.edge.http_port = -1
    async with LocalMesh(settings) as mesh:
        assert mesh.server is not None and mesh.server.pid is not None
        first, url = mesh.server.pid, mesh.nats_url
        async with MeshClient(settings=mesh.settings, first_event_timeout=20) as client:
            before = await client.complete("[tag:b] hi", route="local", max_tokens=4)
            assert before.text == expected_text("b", 4)
            os.kill(first, signal.SIGKILL)  # by PID
            killed = time.monotonic()
            await eventually(lambda: holds(mesh.server_restarts == 1), 20, "started again")
            assert mesh.server.pid != first and mesh.nats_url == url
            after = await client.complete("[tag:a] hi", via="cloud", max_tokens=4)
            assert after.text == expected_text("a", 4)  # through JetStream and a worker
            print(f"\nkilled -> answered via the cloud again: {time.monotonic() - killed:.2f} s")


async def test_a_restart_that_cannot_spawn_is_tried_again(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine out of memory (the OOM killer's case): the new process cannot be spawned.
    The error escaped the restart, and every later try found no process to wait for: the
    server never came back."""
    from mesh import nats_server as spawner

    settings = load_settings(environ={})
    settings.nats.local_port = -1
    settings.nats.store_dir = str(tmp_path)
    settings.worker.model.backend = "deterministic"
    settings.edge.model.backend = "deterministic"
    settings.edge.http_port = -1
    spawn = asyncio.create_subprocess_exec
    failures = [OSError(12, "Cannot allocate memory")]

    async def spawning(*args: object, **kwargs: object) -> object:
        if failures:
            raise failures.pop()
        return await spawn(*args, **kwargs)  # type: ignore[arg-type]

    async with LocalMesh(settings) as mesh:
        assert mesh.server is not None and mesh.server.pid is not None
        monkeypatch.setattr(spawner.asyncio, "create_subprocess_exec", spawning)
        os.kill(mesh.server.pid, signal.SIGKILL)
        await eventually(lambda: holds(mesh.server_restarts == 1), 20, "started again")
        assert not failures  # the first try failed
