"""The edge's HTTP surface at its edges: a non-streaming client that stops reading, an engine
that splits a surrogate pair between events, a request naming a cloud model that the local model
must not answer under its name, fields of the wrong type or that would be ignored, errors that
name their field, and finished HTTP requests that nothing can reach. Each test failed on the
code before its fix (a review of edge_node/http_api.py, http_sinks.py and openai_api.py).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from cloud_node.worker import Worker
from edge_node import http_sinks
from edge_node.node import EdgeNode
from edge_node.router import HeuristicRouter
from mesh.backends.deterministic import DeterministicBackend
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import MeshSettings, ModelSettings
from mesh.connection import Connection

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "[tag:p] hi"}]


@pytest.fixture
async def det_edge(settings: MeshSettings, conn: Connection) -> AsyncIterator[EdgeNode]:
    """An edge on the deterministic backend (``smollm2``), its HTTP API on a free port."""
    settings.edge.model.backend = "deterministic"
    settings.edge.http_port = 0
    backend = DeterministicBackend(settings.edge.model)
    async with EdgeNode(settings, conn, backend, HeuristicRouter()) as node:
        yield node


async def post(
    edge: EdgeNode, path: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    assert edge.http is not None
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http,
        http.post(edge.http.url + path, json=body, headers=headers or {}) as resp,
    ):
        text = await resp.text()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = {"raw": text}
        return resp.status, parsed, dict(resp.headers)


# -- 1. a non-streaming client that stops reading is held for ever ---------------------------


async def test_a_non_streaming_client_that_stops_reading_is_let_go(
    settings: MeshSettings, conn: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose socket stays full for CLIENT_STALL_S is taken for gone, streaming or not
    (tests/test_http_stalled_client.py). Before, the non-streaming path handed its whole answer
    to aiohttp, which waits for the socket without end: the connection, and the answer's
    megabytes in its write buffer, stayed for as long as the client kept the socket open."""
    monkeypatch.setattr(http_sinks, "CLIENT_STALL_S", 0.5)
    settings.edge.http_port = 0
    backend = DeterministicBackend(ModelSettings(backend="deterministic", slots=1))
    edge = EdgeNode(settings, conn, backend, HeuristicRouter())
    await edge.start()
    sock = socket.socket()
    try:
        assert edge.http is not None and edge.http._runner is not None
        body = json.dumps(
            {  # 2 kB a token, 8 MB an answer: more than the sockets on both sides hold
                "messages": [{"role": "user", "content": f"[tag:{'s' * 2000}] go on"}],
                "max_tokens": 4000,
            }
        ).encode()
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Mesh-Route: local\r\n\r\n"
        ).encode()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", edge.http.port))
        await loop.sock_sendall(sock, head + body)  # and never reads a byte
        server = edge.http._runner.server
        assert server is not None
        await asyncio.sleep(1.0)  # the answer is made (instant backend) and being written
        held: list[int] = []
        deadline = time.monotonic() + 6.0  # 12 x CLIENT_STALL_S
        while time.monotonic() < deadline:
            held = [
                c.transport.get_write_buffer_size()
                for c in server.connections
                if c.transport is not None
            ]
            if not held:
                break
            await asyncio.sleep(0.2)
        assert not held, f"the stalled client's connection is still held, bytes buffered: {held}"
    finally:
        sock.close()
        await edge.stop(grace=0)


# -- 2. a streamed answer the non-streamed path delivers ends in an internal error ------------


async def _split_pair_upstream(request: web.Request) -> web.StreamResponse:
    """An OpenAI-compatible engine that sends an emoji's surrogate pair in two events (legal
    JSON escapes; servers that slice UTF-16 strings do this)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunk = (
        '{"id":"x","object":"chat.completion.chunk","created":1,"model":"up",'
        '"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}'
    )
    for piece in ("hi ", "\\ud83d", "\\ude00", " ok"):
        await resp.write(f"data: {chunk % piece}\n\n".encode())
    end = (
        '{"id":"x","object":"chat.completion.chunk","created":1,"model":"up","choices":'
        '[{"index":0,"delta":{},"finish_reason":"stop"}],'
        '"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}'
    )
    await resp.write(f"data: {end}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "up", "object": "model"}]})


async def test_a_streamed_answer_with_a_split_surrogate_pair_is_delivered_not_failed(
    settings: MeshSettings, conn: Connection
) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _split_pair_upstream)
    app.router.add_get("/v1/models", _models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    backend = OpenAIHTTPBackend(
        ModelSettings(backend="openai", base_url=f"http://127.0.0.1:{port}/v1", name="smollm2")
    )
    await backend.start()
    settings.edge.http_port = 0
    try:
        async with EdgeNode(settings, conn, backend, HeuristicRouter()) as edge:
            assert edge.http is not None
            body = {"messages": USER, "max_tokens": 10}
            local = {"X-Mesh-Route": "local"}
            status, whole, _ = await post(edge, CHAT, body, local)
            assert status == 200, whole  # not streamed: the whole answer, the emoji in it
            assert whole["choices"][0]["message"]["content"] == "hi \U0001f600 ok"
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http,
                http.post(edge.http.url + CHAT, json={**body, "stream": True}, headers=local) as r,
            ):
                raw = (await r.read()).decode("utf-8", "replace")
            events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]", raw
            chunks = [json.loads(e) for e in events[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            assert not errors, f"streamed, the same answer ends in {errors} after {raw[:300]!r}"
    finally:
        await backend.close()
        await runner.cleanup()


# -- 3. a request naming a cloud model is answered by the local model, under the cloud's name --


async def _named_model_answer(
    edge: EdgeNode, headers: dict[str, str]
) -> tuple[int, dict[str, Any], dict[str, str]]:
    return await post(
        edge, CHAT, {"model": "big-cloud", "messages": USER, "max_tokens": 3}, headers
    )


def _not_passed_off(status: int, answer: dict[str, Any], headers: dict[str, str]) -> None:
    if status != 200:
        return  # a typed refusal is fine
    assert not (headers.get("X-Mesh-Path") == "local" and answer.get("model") == "big-cloud"), (
        "the edge's local model answered a request for 'big-cloud' and the answer says it is "
        f"big-cloud's: model={answer.get('model')!r}, served_by={headers.get('X-Mesh-Served-By')}"
    )


async def test_forcing_local_on_a_request_naming_a_cloud_model_is_not_passed_off_as_it(
    det_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    settings.worker.model.backend = "deterministic"
    settings.worker.model.name = "big-cloud"
    async with Worker(settings, conn, DeterministicBackend(settings.worker.model)):
        status, answer, headers = await _named_model_answer(det_edge, {"X-Mesh-Route": "local"})
    _not_passed_off(status, answer, headers)
    # An explicit route wins: the local model answers, under its own name.
    assert status == 200 and headers["X-Mesh-Path"] == "local", answer
    assert answer["model"] == det_edge.settings.edge.model.name


async def test_a_named_cloud_model_that_cannot_answer_is_not_replaced_by_the_local_one(
    det_edge: EdgeNode, settings: MeshSettings, conn: Connection
) -> None:
    """A client that names its model gets that model or nothing: its pool's worker gone, the
    request waits in the queue for one, as one too long for the local model does, and ends
    typed at its deadline. Before, the edge's model answered it after ``cloud_start_timeout``,
    under the name ``big-cloud``."""
    det_edge.settings.edge.cloud_start_timeout = 1.0
    det_edge.settings.edge.request_timeout = 2.0  # the deadline of a request that names none
    settings.worker.model.backend = "deterministic"
    settings.worker.model.name = "big-cloud"
    async with Worker(settings, conn, DeterministicBackend(settings.worker.model)):
        status, answer, headers = await _named_model_answer(det_edge, {})
        assert status == 200 and headers["X-Mesh-Path"] == "cloud", answer  # the pool serves
    # Its pool is deployed (its consumer stays) but its worker is gone.
    began = time.monotonic()
    status, answer, headers = await _named_model_answer(det_edge, {})
    _not_passed_off(status, answer, headers)
    assert status == 504 and answer["error"]["code"] == "deadline_exceeded", (status, answer)
    assert time.monotonic() - began < 5.0


# -- 4. hostile or answer-changing fields accepted silently -----------------------------------


@pytest.mark.parametrize(
    ("path", "fields", "named"),
    [
        (CHAT, {"max_tokens": True}, "max_tokens"),
        (CHAT, {"stream": "yes"}, "stream"),
        (CHAT, {"frequency_penalty": "abc"}, "frequency_penalty"),
        (CHAT, {"presence_penalty": 2}, "presence_penalty"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
    ],
    ids=[
        "max_tokens-bool",
        "stream-string",
        "frequency_penalty-string",
        "presence_penalty",
        "best_of",
    ],
)
async def test_a_field_of_the_wrong_type_or_one_the_edge_ignores_is_a_400_naming_it(
    det_edge: EdgeNode, path: str, fields: dict[str, Any], named: str
) -> None:
    """openai_api.py: fields the mesh cannot honour are "refused with a 400 naming the field,
    never silently ignored". Before, these got a 200 (penalties and best_of dropped, a boolean
    read as 1 token, a string as a stream)."""
    base: dict[str, Any] = (
        {"messages": USER, "max_tokens": 3} if path == CHAT else {"prompt": "x", "max_tokens": 3}
    )
    status, answer, _ = await post(det_edge, path, {**base, **fields})
    assert status == 400, (fields, status, str(answer)[:200])
    assert named in json.dumps(answer["error"]), answer


# -- 5. 400s that do not name the field --------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "named", "status"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "  "}]}, "messages", 400),
        (COMPLETIONS, {"prompt": ""}, "prompt", 400),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt", 400),
        (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", 400),
        (CHAT, {"messages": USER, "model": "no-such-model"}, "model", 404),
    ],
    ids=["blank-messages", "empty-prompt", "two-prompts", "echo", "unknown-model"],
)
async def test_a_refused_body_s_error_names_the_field_in_param(
    det_edge: EdgeNode, path: str, body: dict[str, Any], named: str, status: int
) -> None:
    got, answer, _ = await post(det_edge, path, body)
    assert got == status, answer
    assert answer["error"]["param"] == named, answer["error"]


# -- 6. finished HTTP requests are kept though nobody can ever ask for them again -------------


async def test_finished_http_requests_leave_no_records_behind(det_edge: EdgeNode) -> None:
    """Each HTTP request has a scope of its own (``http:<uuid4>``): no later request, resend or
    cancel can reach its record, which is dropped as it finishes. Before, each was kept for
    replay_window (60 s), with its whole event log, its sink and its place among MAX_RECORDS."""
    for _ in range(5):
        status, answer, _ = await post(det_edge, CHAT, {"messages": USER, "max_tokens": 50})
        assert status == 200, answer
    await asyncio.sleep(0.2)
    assert det_edge.records.in_flight() == 0
    assert len(det_edge.records) == 0, f"{len(det_edge.records)} unreachable records kept"
