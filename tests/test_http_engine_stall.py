"""An OpenAI-compatible engine that stops mid-stream becomes a retryable error in time.

The HTTP backend reads a stream without a read timeout of its own (aiohttp would set a timer again
on every token it reads); the generation's stall watchdog stands for it. A real aiohttp server
here sends two tokens, then holds the connection open and silent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import ModelSettings
from mesh.generate import coalesce
from protocol.errors import BackendError
from protocol.messages import InferRequest
from tests.helpers import chat_server


async def _stalling_server() -> AsyncIterator[tuple[str, asyncio.Event]]:
    release = asyncio.Event()

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for text in ("Hello", " there"):
            chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await release.wait()  # silent, the connection open: a hung engine
        return response

    async with chat_server(chat) as base:
        try:
            yield base, release
        finally:
            release.set()  # before the server's cleanup, which waits for this handler


@pytest.mark.parametrize("linger", [0.0, 30.0], ids=["tokens-as-they-come", "batching"])
async def test_an_engine_that_stops_mid_stream_is_a_retryable_error(linger: float) -> None:
    server = _stalling_server()
    base, _release = await server.__anext__()
    backend = OpenAIHTTPBackend(
        ModelSettings(backend="openai", base_url=base, continuation="off", http_timeout=60)
    )
    await backend.start()
    try:
        request = InferRequest(id="stall-1", prompt="hi", max_tokens=32)
        got: list[str] = []

        async def read() -> None:
            async for chunk in coalesce(
                backend.generate(request), max_parts=16, linger=linger, stall=0.4
            ):
                got.append(chunk.text)

        began = time.monotonic()
        with pytest.raises(BackendError) as raised:
            await read()
        waited = time.monotonic() - began
        assert raised.value.retryable
        assert "".join(got) == "Hello there"  # what came before the stall was passed on
        assert waited < 5  # the watchdog's bound (0.4 s and a quarter), not http_timeout (60 s)
        assert backend.capacity().free == backend.settings.slots  # the stream was let go
    finally:
        await backend.close()
        await server.aclose()
