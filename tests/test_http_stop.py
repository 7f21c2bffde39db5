"""An edge that stops while HTTP answers are under way: each gets the stop's grace to finish, and
one still running after it ends with a typed, retryable ``unavailable`` its client reads (an
OpenAI error body with a 503, or the error chunk and ``[DONE]`` closing the SSE stream), as a
NATS requester gets one. Before, aiohttp's own shutdown closed the connections under them: the
non-streaming client got no response at all, the streaming one a stream cut short mid-token."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from tests.helpers import eventually, holds

BODY = {"messages": [{"role": "user", "content": "[tag:hs] go on"}], "route": "local"}


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and the whole body; raises if the connection ends otherwise."""
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def _events(raw: bytes) -> list[Any]:
    data = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_http_answers_under_way_when_the_edge_stops_end_typed(
    settings: MeshSettings, conn: Connection
) -> None:
    settings.edge.http_port = 0
    backend = DeterministicBackend(
        ModelSettings(backend="deterministic", slots=4, token_delay_ms=50, faults=False)
    )
    edge = EdgeNode(settings, conn, backend, HeuristicRouter())
    await edge.start()
    assert edge.http is not None
    url = f"{edge.http.url}/v1/chat/completions"
    long = {**BODY, "max_tokens": 400}  # 20 s of tokens: past any grace here
    whole = asyncio.ensure_future(_post(url, long))
    streamed = asyncio.ensure_future(_post(url, {**long, "stream": True}))
    short = asyncio.ensure_future(_post(url, {**BODY, "max_tokens": 12}))  # 0.6 s: within it
    await eventually(lambda: holds(backend.started == 3), timeout=10, what="three under way")
    await edge.stop(grace=1.0)

    status, headers, raw = await asyncio.wait_for(whole, 10)
    assert status == 503 and headers.get("Retry-After") == "1"
    error = json.loads(raw)["error"]
    assert error["code"] == "unavailable" and error["retryable"] is True

    status, headers, raw = await asyncio.wait_for(streamed, 10)  # read to its proper end
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(raw)
    tokens = [e for e in events[:-2] if e["choices"][0]["delta"].get("content")]
    assert tokens, "the stream had begun"
    assert events[-2]["error"]["code"] == "unavailable" and events[-1] == "[DONE]"

    status, _, raw = await asyncio.wait_for(short, 10)
    assert status == 200
    answer = json.loads(raw)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 12
