"""The edge's OpenAI-compatible HTTP API, over real HTTP to a real edge."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from cloud_node.worker import Worker
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.llama_cpp import LlamaCppBackend
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.messages import InferRequest

CHAT = "/v1/chat/completions"


@pytest.fixture
async def http_edge(
    settings: MeshSettings, conn: Connection, edge_backend: LlamaCppBackend
) -> AsyncIterator[EdgeNode]:
    settings.edge.http_port = 0
    async with EdgeNode(settings, conn, edge_backend, HeuristicRouter()) as node:
        yield node


@pytest.fixture
async def http(http_edge: EdgeNode) -> AsyncIterator[aiohttp.ClientSession]:
    assert http_edge.http is not None
    async with aiohttp.ClientSession(
        base_url=http_edge.http.url, timeout=aiohttp.ClientTimeout(total=60)
    ) as session:
        yield session


def body(content: str = "Say hi.", **extra: object) -> dict[str, object]:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict[str, object] | str]:
    events: list[dict[str, object] | str] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_chat_completion_non_streaming(
    http: aiohttp.ClientSession, http_edge: EdgeNode
) -> None:
    async with http.post(CHAT, json=body()) as resp:
        assert resp.status == 200
        answer = await resp.json()
        assert resp.headers["X-Mesh-Path"] == "local"
        assert resp.headers["X-Mesh-Served-By"] == f"edge:{http_edge.edge_id}"
    assert answer["object"] == "chat.completion" and answer["model"] == "smollm2"
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].strip()
    assert choice["finish_reason"] in {"stop", "length"}
    assert 0 < answer["usage"]["completion_tokens"] <= 8
    assert answer["mesh"]["path"] == "local" and answer["mesh"]["routing"]["decision"] == "local"


async def test_chat_completion_streaming(http: aiohttp.ClientSession) -> None:
    request = body(stream=True, stream_options={"include_usage": True})
    async with http.post(CHAT, json=request) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # type: ignore[index]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])  # type: ignore[index,union-attr]
    assert text.strip()
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])  # type: ignore[index]
    assert final["mesh"]["path"] == "local"  # type: ignore[index]
    assert chunks[-1]["usage"]["completion_tokens"] > 0  # type: ignore[index]


async def test_route_header_sends_it_to_the_cloud(
    http: aiohttp.ClientSession, worker: Worker
) -> None:
    async with http.post(CHAT, json=body(), headers={"X-Mesh-Route": "cloud"}) as resp:
        answer = await resp.json()
    assert answer["mesh"]["path"] == "cloud"
    assert answer["mesh"]["served_by"] == f"cloud:{worker.node_id}"
    assert answer["mesh"]["routing"]["forced"] is True


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{not json", 400, "bad_payload"),
        (json.dumps(body(max_tokens=999_999)).encode(), 400, "invalid_request"),
        (json.dumps(body(max_tokens=5000)).encode(), 400, "invalid_request"),
        (json.dumps({"model": "smollm2", "messages": []}).encode(), 400, "invalid_request"),
        (json.dumps(body(model="gpt-9-ultra")).encode(), 404, "unknown_model"),
        (json.dumps(body(tools=[{"type": "function"}])).encode(), 400, "invalid_request"),
        (json.dumps(body(content="x" * 300_000)).encode(), 413, "payload_too_large"),
    ],
    ids=[
        "bad-json",
        "max-tokens-ceiling",
        "max-tokens-limit",
        "no-messages",
        "unknown-model",
        "tools",
        "too-large",
    ],
)
async def test_http_errors_are_typed(
    http: aiohttp.ClientSession, payload: bytes, status: int, code: str
) -> None:
    async with http.post(CHAT, data=payload, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["code"] == code and error["message"] and error["retryable"] is False


async def test_an_openai_client_reads_the_edge(http_edge: EdgeNode) -> None:
    # Our OpenAI-compatible backend (SSE parsing, usage, [DONE]) talking to the edge's API.
    assert http_edge.http is not None
    client = OpenAIHTTPBackend(ModelSettings(backend="openai", base_url=f"{http_edge.http.url}/v1"))
    await client.start()
    try:
        assert (await client.health()).ok
        chunks = [
            c
            async for c in client.generate(
                InferRequest(prompt="Say hi.", max_tokens=6, temperature=0)
            )
        ]
    finally:
        await client.close()
    assert "".join(c.text for c in chunks).strip()
    assert chunks[-1].finish_reason in {"stop", "length"}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_client_disconnect_frees_the_local_model(http: aiohttp.ClientSession) -> None:
    async with http.post(
        CHAT, json=body("Count to one thousand.", max_tokens=1500, stream=True)
    ) as resp:
        await resp.content.readline()  # the stream has started
    # The connection is gone; the 1500-token generation must stop, not hold the only slot.
    began = time.monotonic()
    async with http.post(CHAT, json=body(max_tokens=4)) as resp:
        assert resp.status == 200
    assert time.monotonic() - began < 8


async def test_models_and_health(http: aiohttp.ClientSession, http_edge: EdgeNode) -> None:
    async with http.get("/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    async with http.get("/health") as resp:
        health = await resp.json()
    assert health["status"] == "ok" and health["edge_id"] == http_edge.edge_id
    await asyncio.sleep(0)


async def test_naming_a_cloud_model_sends_the_request_to_it(
    http: aiohttp.ClientSession, settings: MeshSettings, conn: Connection
) -> None:
    from mesh.backends.llama_cpp import LlamaCppBackend as Engine

    cloud = Engine(ModelSettings(name="cloudy"))  # the same GGUF, served as another model
    await cloud.start()
    try:
        async with Worker(settings, conn, cloud) as worker:
            async with http.post(CHAT, json=body(model="cloudy")) as resp:
                answer = await resp.json()
            assert answer["mesh"]["path"] == "cloud", answer
            assert answer["mesh"]["served_by"] == f"cloud:{worker.node_id}"
            assert answer["model"] == "cloudy"
            async with http.post(CHAT, json=body(model="cloudy", route="local")) as resp:
                assert (await resp.json())["mesh"]["path"] == "local"  # an explicit route wins
    finally:
        await cloud.close()
