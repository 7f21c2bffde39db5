"""A streaming HTTP client that stops reading does not hold its place at the edge for as long as
it keeps the connection open: once its socket is full and stays full for ``CLIENT_STALL_S``, the
edge takes it for gone and closes the connection (its request is cancelled, or ends at once
without it)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from edge_node import http_sinks
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.client import MeshClient
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection


async def test_a_streaming_client_that_stops_reading_is_let_go(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_sinks, "CLIENT_STALL_S", 0.5)
    settings.edge.http_port = 0
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=1))
    edge = EdgeNode(settings, conn, backend, HeuristicRouter())
    await edge.start()
    try:
        assert edge.http is not None
        port = edge.http.port
        body = json.dumps(
            {
                # 2 kB a token, 8 MB an answer: more than the sockets on both sides hold.
                "messages": [{"role": "user", "content": f"[tag:{'s' * 2000}] go on"}],
                "max_tokens": 4000,
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "X-Mesh-Route: local\r\n\r\n"
        ).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, head + body)  # and never reads a byte
        try:
            # The edge lets it go: the answer goes on without it (the instant backend ends it at
            # once) and the connection is closed. Before, the request held the only local slot
            # for as long as the connection stayed open: this one would wait past its deadline.
            async with MeshClient(settings=settings) as client:
                after = await client.complete(
                    "[tag:t] short", route="local", max_tokens=3, deadline=time.time() + 10
                )
            assert after.end.usage.completion_tokens == 3 and backend.started == 2
            got = bytearray()
            while data := await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5):
                got += data  # what the sockets held when the edge closed the connection
            assert got.startswith(b"HTTP/1.1 200") and b"[DONE]" not in got
            assert len(got) < 4000 * 2000
        finally:
            sock.close()
    finally:
        await edge.stop(grace=0)
