"""An SSE stream cannot take text back: when the cloud's answer stalls mid-stream and the edge
starts it over locally, the stream ends at once in a typed ``incomplete`` and ``[DONE]``. Nobody
reads the local answer then, and it is stopped: the response ends with the error, and the local
slot is free. Before, the edge made the unread answer to its end (here 5 s of tokens), holding
the response open and the local model busy all that time."""

from __future__ import annotations

import json
import time

import aiohttp

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from tests.helpers import eventually, holds

LOCAL_TOKENS = 100
LOCAL_TOKEN_MS = 50  # the whole local answer: 5 s


async def test_a_stream_ended_by_a_restart_stops_the_answer_nobody_reads(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.http_port = 0
    settings.worker.report_stall_after = 0.5  # the cloud's engine stands still: it says so
    cloud = DeterministicBackend(ModelSettings(backend="deterministic", slots=2, token_delay_ms=20))
    local = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=1, token_delay_ms=LOCAL_TOKEN_MS, faults=False)
    )
    async with (
        Worker(settings, conn, cloud),
        EdgeNode(settings, conn, local, HeuristicRouter()) as edge,
    ):
        assert edge.http is not None
        body = {
            "messages": [{"role": "user", "content": "[tag:sr] [hang-after:5] count"}],
            "max_tokens": LOCAL_TOKENS,
            "stream": True,
            "route": "cloud",
        }
        lines: list[bytes] = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{edge.http.url}/v1/chat/completions", json=body) as resp,
        ):
            async for line in resp.content:
                lines.append(line)
                if b"[DONE]" in line:
                    done_at = time.monotonic()
        ended_at = time.monotonic()
        events = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
        assert events[-1]["error"]["code"] == "incomplete", events[-1]
        assert local.started == 1  # the edge did start it over locally
        # The response ended with its error, not with the unread local answer's last token.
        assert ended_at - done_at < LOCAL_TOKENS * LOCAL_TOKEN_MS / 1000 / 2
        # And the local model is free again, long before that answer could have ended.
        await eventually(
            lambda: holds(not edge.records.in_flight()), timeout=2, what="the local answer gone"
        )
