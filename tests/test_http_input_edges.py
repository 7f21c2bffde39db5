"""The edge's HTTP APIs at their edges (edge_node/http_api.py, http_sinks.py, openai_api.py,
api_keys.py): lone surrogates in a stream, a keys file that is not UTF-8, sampling values of the
wrong JSON type. Each test failed on the code before its fix (review S17a); its docstring says
what a client saw then ("Before"). Real nats-server (fixtures), real edge, real HTTP; an
OpenAI-compatible upstream engine served by aiohttp stands in for a buggy or hostile engine
where one is needed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from edge_node import api_keys
from edge_node.api_keys import ApiKeys
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection
from protocol.errors import InvalidRequestError

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "[tag:p] hi"}]
KEY = "key-of-app-a-0123456789"


def _chunk(content: str, logprobs: bool = False) -> str:
    """One upstream chat chunk; ``content`` is raw JSON string text (escapes allowed)."""
    lp = (
        f',"logprobs":{{"content":[{{"token":"{content}","logprob":-0.5,"top_logprobs":[]}}]}}'
        if logprobs
        else ""
    )
    return (
        '{"id":"x","object":"chat.completion.chunk","created":1,"model":"up","choices":'
        f'[{{"index":0,"delta":{{"content":"{content}"}}{lp},"finish_reason":null}}]}}'
    )


_END = (
    '{"id":"x","object":"chat.completion.chunk","created":1,"model":"up","choices":'
    '[{"index":0,"delta":{},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
)


async def _split_pair_with_logprobs(request: web.Request) -> web.StreamResponse:
    """An engine that cuts an emoji's surrogate pair between two events (as the one in
    tests/test_http_answer_edges.py), each event's logprobs token being its text."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in ("hi ", "\\ud83d", "\\ude00", " ok"):
        await resp.write(f"data: {_chunk(piece, logprobs=True)}\n\n".encode())
    await resp.write(f"data: {_END}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


async def _error_with_a_lone_surrogate(request: web.Request) -> web.StreamResponse:
    """An engine that streams two tokens, then reports an error mid-stream whose message holds
    a lone surrogate (a legal JSON escape)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in ("hi ", "there "):
        await resp.write(f"data: {_chunk(piece)}\n\n".encode())
    await resp.write(b'data: {"error": {"message": "engine fault \\ud800 here"}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "up", "object": "model"}]})


async def _edge_on_upstream(
    settings: MeshSettings, conn: Connection, handler: Any, **model: Any
) -> AsyncIterator[EdgeNode]:
    app = web.Application()
    app.router.add_post(CHAT, handler)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    backend = OpenAIHTTPBackend(
        ModelSettings(
            backend="openai", base_url=f"http://127.0.0.1:{port}/v1", name="smollm2", **model
        )
    )
    await backend.start()
    settings.edge.http_port = 0
    try:
        async with EdgeNode(settings, conn, backend, HeuristicRouter()) as edge:
            yield edge
    finally:
        await backend.close()
        await runner.cleanup()


async def _raw_stream(port: int, body: dict[str, Any], limit: float = 5.0) -> bytes:
    """What a streaming client receives on the wire, until ``[DONE]``, EOF or ``limit``."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"POST {CHAT} HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
            f"X-Mesh-Route: local\r\nContent-Length: {len(raw)}\r\n\r\n"
        ).encode()
        + raw
    )
    got = b""
    deadline = time.monotonic() + limit
    try:
        while b"data: [DONE]" not in got and (left := deadline - time.monotonic()) > 0:
            data = await asyncio.wait_for(reader.read(65536), left)
            if not data:
                break
            got += data
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
    return got


# -- 1. first rule: a streamed answer ends neither typed nor at all --------------------------


async def test_a_streamed_error_whose_message_holds_a_lone_surrogate_still_ends_typed(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (first rule). The engine fails mid-stream with an error message holding
    a lone surrogate. Not streamed, the client gets a typed 502. Streamed, SSESink._fail's
    ``json.dumps(ensure_ascii=False).encode()`` raises UnicodeEncodeError inside
    ``record.fail``; it escapes EdgeNode.serve, the openai_errors middleware answers it with a
    *second* HTTP response ("HTTP/1.1 500 ...") written into the already-started chunked SSE
    body, and the connection is left open: the client sees two tokens, then garbage, no error
    event and no [DONE], and waits until its own timeout."""
    async for edge in _edge_on_upstream(settings, conn, _error_with_a_lone_surrogate):
        assert edge.http is not None
        got = await _raw_stream(
            edge.http.port, {"messages": USER, "max_tokens": 10, "stream": True}
        )
        text = got.decode("utf-8", "replace")
        assert text.startswith("HTTP/1.1 200"), text[:200]
        assert text.count("HTTP/1.1 ") == 1, f"a second response inside the stream: {text!r}"
        assert '"error"' in text and "data: [DONE]" in text, (
            f"the stream neither ended typed nor ended within 5 s: {text[-400:]!r}"
        )


async def test_streamed_logprobs_of_a_split_surrogate_pair_do_not_fail_the_answer(
    settings: MeshSettings, conn: Connection
) -> None:
    """Before (first rule / typed). The same answer as in
    tests/test_http_answer_edges.py (an engine that cuts an emoji's surrogate pair between two
    events), asked with ``logprobs``. Not streamed: 200, the emoji in the text. Streamed: the
    answer's text is mended but its logprobs token is not, and SSESink._send's
    ``json.dumps(..., ensure_ascii=False).encode()`` raises UnicodeEncodeError, which fails the
    request as ``internal`` "edge failure" after its first chunk."""
    async for edge in _edge_on_upstream(settings, conn, _split_pair_with_logprobs, logprobs=True):
        assert edge.http is not None
        body = {"messages": USER, "max_tokens": 10, "logprobs": True}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(edge.http.url + CHAT, json=body, headers={"X-Mesh-Route": "local"}) as r,
        ):
            whole = await r.json()
            assert r.status == 200, whole
        assert whole["choices"][0]["message"]["content"] == "hi \U0001f600 ok"
        got = await _raw_stream(edge.http.port, {**body, "stream": True})
        events = [
            line[6:]
            for line in got.decode("utf-8", "replace").split("\n")
            if line.startswith("data: ")
        ]
        assert events and events[-1].strip() == "[DONE]", got[-300:]
        chunks = [json.loads(e) for e in events[:-1]]
        errors = [c["error"] for c in chunks if "error" in c]
        assert not errors, f"streamed, the answer the whole path delivers fails: {errors}"
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
        )
        assert text == "hi \U0001f600 ok"


# -- 2. typed / heal: a keys file edited into non-UTF-8 ---------------------------------------


async def test_a_keys_file_edited_into_non_utf8_keeps_the_keys_last_read(
    settings: MeshSettings, conn: Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before (typed / heal). docs/http-api.md: "a file broken by an edit keeps the
    keys last read (the log says so)". ApiKeys._follow catches OSError and
    InvalidRequestError, but read_text() of a file with a Latin-1 byte (an editor's "café" in a
    comment) raises UnicodeDecodeError: it escapes into the middleware, and the request with a
    valid key gets a 500 ``internal`` "edge failure". With the default RECHECK_S (1 s), every
    /v1 request more than a second after the last re-check fails so, until the file is fixed.
    (RECHECK_S is 0 here so the first request re-reads the file.)"""
    path = tmp_path / "api-keys"
    path.write_text(f"app-a {KEY}\n")
    settings.edge.http_port = 0
    settings.edge.api_keys_file = str(path)
    monkeypatch.setattr(api_keys, "RECHECK_S", 0.0)
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=2))
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as edge:
        assert edge.http is not None
        path.write_bytes(f"# caf\xe9 kiosk\napp-a {KEY}\n".encode("latin-1"))
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(
                edge.http.url + CHAT,
                json={"messages": USER, "max_tokens": 2},
                headers={"Authorization": f"Bearer {KEY}"},
            ) as resp,
        ):
            answer = await resp.json()
    assert resp.status == 200, answer


def test_a_non_utf8_keys_file_at_start_is_refused_typed(tmp_path: Path) -> None:
    """Before (typed, minor). At start "a bad file stops the edge, naming the line";
    a non-UTF-8 one raises a raw UnicodeDecodeError from ApiKeys.__init__ instead of the
    InvalidRequestError naming the file that every other bad file gets."""
    path = tmp_path / "api-keys"
    path.write_bytes(f"# caf\xe9\napp-a {KEY}\n".encode("latin-1"))
    with pytest.raises(InvalidRequestError):
        ApiKeys(path)


# -- 3. minor: a value of the wrong JSON type accepted ------------------------------------------


@pytest.fixture
async def det_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    settings.edge.model.backend = "deterministic"
    settings.edge.http_port = 0
    async with EdgeNode(
        settings, conn, DeterministicBackend(settings.edge.model), HeuristicRouter()
    ) as node:
        yield node


@pytest.mark.parametrize(
    "fields",
    [{"temperature": "0.5"}, {"temperature": True}, {"top_p": "1"}, {"top_p": True}],
    ids=["temperature-string", "temperature-bool", "top_p-string", "top_p-bool"],
)
async def test_a_sampling_value_of_the_wrong_json_type_is_a_400(
    det_edge: EdgeNode, fields: dict[str, Any]
) -> None:
    """Before (minor). docs/http-api.md: "a value of the wrong JSON type
    (``"max_tokens": true``, ``"stream": "yes"``)" is refused with a 400 naming the field.
    ``temperature`` and ``top_p`` are lax ``float`` fields in openai_api._Body: a string is
    parsed (``"0.5"`` -> 0.5) and a boolean read as 1.0, and the request is answered (200)."""
    assert det_edge.http is not None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
        http.post(
            det_edge.http.url + CHAT, json={"messages": USER, "max_tokens": 2, **fields}
        ) as resp,
    ):
        answer = await resp.json()
    assert resp.status == 400, (fields, answer)
    assert answer["error"]["param"] == next(iter(fields)), answer


async def test_tool_choice_none_asks_for_nothing_and_is_answered(det_edge: EdgeNode) -> None:
    """``tool_choice: "none"`` asks for no tool call: answered, as OpenAI does. Before, it was
    refused (400, not supported) with every other value; another value still is."""
    assert det_edge.http is not None
    url = det_edge.http.url + CHAT
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for choice, status in (("none", 200), ("auto", 400), (None, 200)):
            body = {"messages": USER, "max_tokens": 2, "tool_choice": choice}
            async with http.post(url, json=body) as resp:
                answer = await resp.json()
            assert resp.status == status, (choice, answer)
            if status == 400:
                assert answer["error"]["param"] == "tool_choice", answer


async def test_a_model_name_the_edge_and_its_cloud_share_is_listed_as_the_edge_s(
    det_edge: EdgeNode,
) -> None:
    """With the local model and the cloud model under one name (the default), ``GET /v1/models``
    lists it once, owned by the edge, whose model answers a request naming it (the router may
    escalate it). Before, the cloud's entry replaced the edge's."""
    assert det_edge.http is not None
    name = det_edge.backend.model
    det_edge.settings.edge.cloud_model = name
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(det_edge.http.url + "/v1/models") as resp:
            listed = (await resp.json())["data"]
        async with http.get(det_edge.http.url + f"/v1/models/{name}") as resp:
            one = await resp.json()
    assert [(m["id"], m["owned_by"]) for m in listed] == [(name, "edge")]
    assert one["owned_by"] == "edge", one
