"""A connection the server ends for good: nats-py closes its client after a server error such
as ``-ERR 'User Authentication Expired'`` (what nats-server says when a user JWT expires on a
live connection) and never reconnects. Nothing noticed: a node ran on with no link for good,
its ``/ready`` 503 while ``/health`` said 200, and a rotated credentials file was never read.
Now the connection says so (``closed_for_good``), and ``mesh edge`` / ``mesh worker`` / ``mesh
up`` stop in order and exit 1, so that their supervisor starts them again, connecting anew."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from mesh.connection import Connection
from mesh.nats_server import NatsServer
from mesh.testing.proxy import TcpProxy
from tests.conftest import linked_settings

ROOT = Path(__file__).resolve().parent.parent


async def test_a_connection_the_server_ends_for_good_says_so(nats_server: NatsServer) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    try:
        settings = linked_settings(proxy.url)
        async with Connection(settings.nats, "expiring") as conn:
            assert not conn.closed_for_good.is_set()
            proxy.say_and_close()
            await asyncio.wait_for(conn.closed_for_good.wait(), 5)
            assert conn.nc.is_closed
        assert conn.closed_for_good.is_set()
    finally:
        await proxy.stop()


async def test_mesh_edge_exits_1_when_the_server_ends_its_connection(
    nats_server: NatsServer,
) -> None:
    proxy = await TcpProxy(nats_server.port).start()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MESH_NATS_URL": proxy.url,
        "MESH_NATS_RECONNECT_WAIT": "0.1",
        "MESH_EDGE_EDGE_ID": "expiring-edge",
        "MESH_EDGE_MODEL_BACKEND": "deterministic",
        "MESH_EDGE_HTTP_PORT": "-1",
    }
    edge = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mesh_app.cli",
        "edge",
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert edge.stdout is not None
        seen: list[str] = []
        while not any("edge started" in line for line in seen):  # serving
            line = await asyncio.wait_for(edge.stdout.readline(), 60)
            assert line, "".join(seen)[-2000:]  # it ended before it served
            seen.append(line.decode(errors="replace"))
        proxy.say_and_close()
        assert await asyncio.wait_for(edge.wait(), 20) == 1
        output = "".join(seen) + (await edge.stdout.read()).decode(errors="replace")
        assert "closed for good" in output, output[-2000:]
    finally:
        if edge.returncode is None:
            edge.kill()
            await edge.wait()
        await proxy.stop()
