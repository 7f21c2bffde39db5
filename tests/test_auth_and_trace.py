"""NATS credentials from settings, and W3C trace context carried from a client to the worker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from cloud_node.worker import Worker
from mesh.config import LogSettings, MeshSettings, NatsSettings
from mesh.connection import Connection
from mesh.logs import configure_logging
from mesh.nats_server import NatsServer
from protocol.errors import UnavailableError
from tests.nats_wire import RawNatsClient

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def test_token_auth(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text(
        f'port: -1\njetstream {{ store_dir: "{tmp_path / "js"}" }}\n'
        'authorization { token: "s3cret-token" }\n'
    )
    async with NatsServer(config=str(conf)) as server:
        async with Connection(NatsSettings(url=server.url, token="s3cret-token"), "ok") as conn:
            assert conn.nc.is_connected
        with pytest.raises(UnavailableError) as excinfo:
            await Connection(NatsSettings(url=server.url, connect_timeout=2), "no-auth").connect()
        assert "cannot connect to NATS" in str(excinfo.value)


async def test_traceparent_reaches_the_worker(
    worker: Worker, edge: object, settings: MeshSettings
) -> None:
    from edge_node.node import EdgeNode

    assert isinstance(edge, EdgeNode)
    configure_logging(LogSettings(level="info"))
    cli = await RawNatsClient().connect(settings.nats.url or "")
    try:
        with structlog.testing.capture_logs([structlog.contextvars.merge_contextvars]) as logs:
            reply = await cli.request(
                edge.subject,
                b'{"prompt": "Hi", "route": "cloud", "max_tokens": 4}',
                headers={"traceparent": TRACEPARENT},
            )
            await asyncio.sleep(0.2)  # the worker logs after its ack
    finally:
        configure_logging(LogSettings(level="warning"))
        await cli.close()
    assert reply.json()["path"] == "cloud"
    done = [e for e in logs if e["event"] == "request done"]
    assert done and done[0]["traceparent"] == TRACEPARENT
