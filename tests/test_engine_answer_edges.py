"""The OpenAI-compatible HTTP backend against engines that misbehave as real ones do: a second
choice, text after the finish, malformed events, Retry-After, several tokens in one event, a
reset after the finish, impossible usage, an engine past ``max_tokens``. Each failed on the code
before its fix (review S16e), but the stall test, which passed as a control.

Each test runs a tiny aiohttp server (tests.helpers.chat_server) that misbehaves exactly as
needed, and reads the backend's chunks directly (or through ``coalesce``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from mesh.backends.base import Chunk
from mesh.backends.openai_http import OpenAIHTTPBackend
from mesh.config import ModelSettings
from mesh.generate import coalesce
from protocol.errors import MeshError
from protocol.messages import InferRequest
from tests.helpers import chat_server

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _sse(events: list[object], *, done: bool = True) -> Handler:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            data = event if isinstance(event, bytes) else json.dumps(event).encode()
            await response.write(b"data: " + data + b"\n\n")
        if done:
            await response.write(b"data: [DONE]\n\n")
        return response

    return chat


async def _run(
    handler: Handler, request: InferRequest | None = None, *, stall: float | None = None
) -> tuple[list[Chunk], BaseException | None]:
    request = request or InferRequest(id="r-1", prompt="hi", max_tokens=32)
    got: list[Chunk] = []
    err: BaseException | None = None
    async with chat_server(handler) as base:
        backend = OpenAIHTTPBackend(
            ModelSettings(backend="openai", base_url=base, continuation="off", http_timeout=5)
        )
        await backend.start()
        try:
            chunks = backend.generate(request)
            if stall is not None:
                chunks = coalesce(chunks, max_parts=16, linger=0.0, stall=stall)
            try:
                async with asyncio.timeout(10):
                    async for chunk in chunks:
                        got.append(chunk)
            except Exception as exc:
                err = exc
        finally:
            await backend.close()
    return got, err


def _delta(text: str, *, index: int = 0, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]}


# -- 1. a choice other than index 0 is spliced into the answer ------------------------------------


async def test_a_second_choice_is_not_spliced_into_the_answer() -> None:
    """An engine (or a proxy that fans out, or n>1 set server-side) streams choices 0 and 1
    interleaved. The answer must be choice 0's text only (or a typed error), never a mix."""
    events = [
        _delta("Hello", index=0),
        _delta("FOREIGN", index=1),
        _delta(" world", index=0),
        _delta("", index=1, finish="stop"),
        _delta("", index=0, finish="stop"),
    ]
    got, err = await _run(_sse(events))
    text = "".join(c.text for c in got)
    assert err is None or isinstance(err, MeshError)
    if err is None:
        assert text == "Hello world", f"answer mixes choices: {text!r}"


# -- 2. content after the finish reason --------------------------------------------------------


async def test_text_after_the_finish_reason_is_not_part_of_the_answer() -> None:
    """A choice that finished cannot grow: text arriving after its finish_reason (a buggy engine,
    a proxy replaying a chunk) must not be appended to the answer."""
    events = [_delta("Hi", finish="stop"), _delta(" EXTRA")]
    got, err = await _run(_sse(events))
    text = "".join(c.text for c in got)
    assert err is None or isinstance(err, MeshError)
    if err is None:
        assert text == "Hi", f"text after the finish was appended: {text!r}"


# -- 3. malformed events escape as non-MeshError exceptions ----------------------------------------


@pytest.mark.parametrize(
    "event",
    [
        b'{"choices": ["x"]}',
        b'{"choices": [{"index": 0, "delta": "x"}]}',
        b'{"choices": [{"index": 0, "delta": {"content": 5}}]}',
        b'{"usage": 7, "choices": []}',
        b'{"choices": [{"index": 0, "delta": {"content": "\xff\xfe"}}]}',
    ],
    ids=[
        "choice-not-object",
        "delta-not-object",
        "content-not-string",
        "usage-not-object",
        "invalid-utf8",
    ],
)
async def test_a_malformed_event_is_a_typed_backend_error(event: bytes) -> None:
    """The Backend contract (mesh/backends/base.py): engine failures raise BackendError (or a
    MeshError). A malformed event escapes as AttributeError / UnicodeDecodeError /
    ValidationError, which the worker reports as 'worker failure' (code internal, retryable),
    and the edge's local path as a crash."""
    _got, err = await _run(_sse([_delta("ok"), event, _delta("", finish="stop")]))
    assert err is not None, "a malformed event was accepted silently"
    assert isinstance(err, MeshError), f"escaped as {type(err).__name__}: {err}"


# -- 4. Retry-After is dropped -------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 503])
async def test_retry_after_of_an_overloaded_engine_is_kept(status: int) -> None:
    """An engine at capacity answers 429/503 with Retry-After; the typed error should carry it
    (retry_after), so the redelivery waits that long instead of nak(delay=1.0) and burning
    the request's deliveries in seconds (outcomes.failed)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"error": {"message": "busy", "type": "server_busy"}},
            status=status,
            headers={"Retry-After": "7"},
        )

    _got, err = await _run(chat)
    assert isinstance(err, MeshError) and err.retryable
    assert err.retry_after == 7, f"retry_after={err.retry_after!r}"


# -- 5. a token event carrying several tokens ----------------------------------------------------


async def test_a_multi_token_event_counts_its_tokens() -> None:
    """vLLM with speculative decoding (or --stream-interval) sends several tokens in one event.
    Chunk.n is 'engine tokens in text' and logprobs 'one entry per engine token'; here the
    event has two logprob entries yet n=1, so the answer's token count (resume.tokens after a
    takeover, max_tokens - prefix_tokens of the continuation, usage of a resumed answer)
    undercounts."""
    event = {
        "choices": [
            {
                "index": 0,
                "delta": {"content": "Hello world"},
                "logprobs": {
                    "content": [
                        {"token": "Hello", "logprob": -0.1, "top_logprobs": []},
                        {"token": " world", "logprob": -0.2, "top_logprobs": []},
                    ]
                },
            }
        ]
    }
    request = InferRequest(id="r-lp", prompt="hi", max_tokens=32, logprobs=True)
    got, err = await _run(_sse([event, _delta("", finish="stop")]), request)
    assert err is None
    tokens = [c for c in got if c.finish_reason is None]
    assert len(tokens[0].logprobs or []) == 2
    assert tokens[0].n == 2, f"n={tokens[0].n} for a chunk of 2 tokens"


# -- 6. a complete answer, then the connection resets before [DONE] --------------------------------


async def test_a_reset_after_the_finish_reason_keeps_the_complete_answer() -> None:
    """The engine sent every token and the finish reason; the connection then resets before
    the usage event and [DONE] (a proxy's idle cut, a restart). A clean EOF here is accepted
    as complete; a reset turns the same complete answer into UnavailableError, and the
    redelivery then asks the engine to continue an answer that already ended."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(_delta("Hi")).encode() + b"\n\n")
        await response.write(b"data: " + json.dumps(_delta("", finish="stop")).encode() + b"\n\n")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()  # no terminating chunk: a reset mid-body
        return response

    got, err = await _run(chat)
    assert err is None, f"a complete answer failed: {type(err).__name__}: {err}"
    assert "".join(c.text for c in got) == "Hi"
    assert got[-1].finish_reason == "stop"


# -- 7. role-only deltas forever (expected to PASS: stall detection covers it) ---------------------


async def test_role_only_deltas_forever_are_a_stall() -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
        with contextlib.suppress(Exception):
            for _ in range(400):
                await response.write(b"data: " + json.dumps(role).encode() + b"\n\n")
                await asyncio.sleep(0.02)
        return response

    _got, err = await _run(chat, stall=0.4)
    assert isinstance(err, MeshError) and err.retryable, repr(err)


# -- 8. usage that cannot be true is passed on ---------------------------------------------------


async def test_a_negative_usage_is_not_passed_on() -> None:
    """The engine's usage goes to the client's end event as it came (Usage has no bounds):
    negative counts reach the client. Expected: a typed error, or usage that is never negative."""
    usage = {"usage": {"prompt_tokens": -3, "completion_tokens": -9}, "choices": []}
    got, err = await _run(_sse([_delta("ok"), _delta("", finish="stop"), usage]))
    assert err is None or isinstance(err, MeshError)
    if err is None:
        final = got[-1].usage
        assert final is not None
        assert final.prompt_tokens >= 0 and final.completion_tokens >= 0, f"usage={final!r}"


# -- 9. an engine that ignores max_tokens ---------------------------------------------------------


async def test_an_engine_that_ignores_max_tokens_does_not_overrun_the_answer() -> None:
    """max_tokens=3; the engine (a server with a lower-bound override, a proxy that drops the
    field) streams 6 tokens. The mesh passes all six on with finish 'stop': the client gets more
    than it asked for. Expected: at most 3 tokens, finish 'length' (the backend stops reading)."""
    events = [_delta(f"t{i} ") for i in range(6)] + [_delta("", finish="stop")]
    request = InferRequest(id="r-max", prompt="hi", max_tokens=3)
    got, err = await _run(_sse(events), request)
    assert err is None or isinstance(err, MeshError)
    if err is None:
        n = sum(c.n for c in got if c.finish_reason is None)
        assert n <= 3, f"{n} tokens for max_tokens=3, finish={got[-1].finish_reason!r}"
