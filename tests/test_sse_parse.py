"""The OpenAI-compatible backend's server-sent-event parser: whatever pieces the connection hands
over (a CRLF or a multi-byte character cut in two, several events at once, one byte at a time),
the same ``data:`` payloads in the same order."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from mesh.backends.base import Chunk
from mesh.backends.openai_http import OpenAIHTTPBackend, _Reading, _SseLines, parse_event
from mesh.config import ModelSettings
from protocol.errors import BackendError
from protocol.messages import InferRequest
from tests.helpers import chat_server

STREAM = (
    ": a comment the server sends to keep the line open\n\n"
    'data: {"choices":[{"delta":{"content":"héllo"}}]}\n\n'
    'data: {"choices":[{"delta":{"content":"wörld \\u2028 ✓"}}]}\r\n\r\n'
    "event: message\n"
    "data: first line\n"
    "data: second line\n\n"
    "data:no space after the colon\r\r"
    "data: [DONE]"  # the last event, with no end at all
)
WANT = [
    '{"choices":[{"delta":{"content":"héllo"}}]}',
    '{"choices":[{"delta":{"content":"wörld \\u2028 ✓"}}]}',
    "first line\nsecond line",
    "no space after the colon",
    "[DONE]",
]


async def _parse(pieces: list[bytes]) -> list[str]:
    parser = _SseLines()
    out: list[str] = []
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.close()


def _cut(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(data):
        step = rng.randint(1, 12)
        pieces.append(data[at : at + step])
        at += step
    return pieces


async def test_whole_stream_at_once() -> None:
    assert await _parse([STREAM.encode()]) == WANT


async def test_one_byte_at_a_time() -> None:
    data = STREAM.encode()
    assert await _parse([data[i : i + 1] for i in range(len(data))]) == WANT


@pytest.mark.parametrize("seed", range(20))
async def test_random_pieces(seed: int) -> None:
    assert await _parse(_cut(STREAM.encode(), seed)) == WANT


async def test_a_crlf_cut_between_its_two_bytes_ends_one_line() -> None:
    assert await _parse([b"data: a\r", b"\n\r", b"\ndata: b\r\n", b"\r\n"]) == ["a", "b"]
    assert await _parse([b"data: a\r\n", b"data: b\r\n\r\n"]) == ["a\nb"]
    assert await _parse([b"data: a\r", b"\ndata: b\r", b"\n\r\n"]) == ["a\nb"]
    assert await _parse([b"data: a\r", b"data: b\r", b"\r"]) == ["a\nb"]


async def test_one_whole_event_per_piece_as_servers_send_them() -> None:
    """The usual piece (one event of one data line, nothing pending) takes the parser's short
    way; what came before it still counts."""
    assert await _parse([b'data: {"a":1}\n\n', b"data:x\n\n", b"data:\n\n"]) == ['{"a":1}', "x", ""]
    assert await _parse([b"data: a\n", b"data: b\n\n"]) == ["a\nb"]  # a data line pending
    assert await _parse([b"data: a\r", b"data: b\n\n"]) == ["a\nb"]  # a line ended by CR
    assert await _parse([b"data: a\n\n", b"data: b\ndata: c\n\n"]) == ["a", "b\nc"]
    assert await _parse([b"dataset: a\n\n", b"data: b\r\n\n"]) == ["b"]


# -- the backend over a real HTTP server, sending these bytes as they are ---------------------
def _event(content: str | None = None, finish: str | None = None) -> bytes:
    choice: dict[str, object] = {"index": 0, "delta": {"content": content} if content else {}}
    if finish:
        choice["finish_reason"] = finish
    return f"data: {json.dumps({'choices': [choice]})}\r\n\r\n".encode()


@contextlib.asynccontextmanager
async def _backend(body: bytes, pieces: int = 7) -> AsyncIterator[OpenAIHTTPBackend]:
    """The backend, against a server that answers every chat completion with ``body``, written
    in ``pieces`` writes."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        step = max(1, len(body) // pieces)
        for at in range(0, len(body), step):
            await response.write(body[at : at + step])
        await response.write_eof()
        return response

    async with chat_server(chat) as base:
        backend = OpenAIHTTPBackend(ModelSettings(backend="openai", base_url=base, http_timeout=10))
        await backend.start()
        try:
            yield backend
        finally:
            await backend.close()


async def _generate(body: bytes) -> list[Chunk]:
    async with _backend(body) as backend:
        request = InferRequest(id="sse-1", prompt="hi", max_tokens=8)
        return [chunk async for chunk in backend.generate(request)]


async def test_the_backend_reads_every_token_and_the_finish() -> None:
    body = _event("Hé") + _event("llo ✓") + _event(finish="stop") + b"data: [DONE]\r\n\r\n"
    chunks = await _generate(body)
    assert [c.text for c in chunks[:-1]] == ["Hé", "llo ✓"]
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2


async def test_nothing_after_done_is_read() -> None:
    body = _event("a") + _event(finish="stop") + b"data: [DONE]\n\n" + _event("stray")
    assert [c.text for c in await _generate(body)] == ["a", ""]


async def test_a_stream_cut_before_its_finish_is_an_error_not_a_short_answer() -> None:
    with pytest.raises(BackendError, match="ended the stream before the answer was complete"):
        await _generate(_event("a") + _event("b"))


async def test_an_error_event_mid_stream_is_an_error() -> None:
    body = _event("a") + b'data: {"error": {"message": "out of memory"}}\n\n'
    with pytest.raises(BackendError, match="out of memory"):
        await _generate(body)


async def test_a_malformed_event_is_an_error() -> None:
    with pytest.raises(BackendError, match="malformed event"):
        await _generate(_event("a") + b"data: {not json\n\n")


# -- one event's JSON ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        '{"choices":[{"index":0,"delta":{"content":" h\\u00e9llo \\u2028 ✓"},"finish_reason":0}]}',
        '{"choices":[{"logprobs":{"content":[{"token":"a","logprob":-0.0001,"top_logprobs":[]}]}}]}',
        '{"usage":{"prompt_tokens":12,"completion_tokens":3},"choices":[]}',
        '{"a": NaN, "b": -Infinity, "c": Infinity}',  # orjson refuses these: json reads them
        '{"a": "\\ud800 a lone surrogate"}',
        '{"a": 1, "a": 2}',
        "[1.5e300, 0.1, -0.0, 5e-324]",
        '"[DONE] as a string"',
    ],
)
def test_an_event_reads_as_json_reads_it(data: str) -> None:
    read, want = parse_event(data), json.loads(data)
    assert json.dumps(read) == json.dumps(want)  # NaN != NaN: compare their spelling
    assert type(read) is type(want)


@pytest.mark.parametrize("data", ['{"a":', "{not json", "", '{"a": 01}', "[1,]"])
def test_an_event_json_refuses_is_refused_as_json_refuses_it(data: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(data)
    with pytest.raises(json.JSONDecodeError):
        parse_event(data)


def test_surrogate_halves_are_joined_across_events_and_a_lone_one_is_a_replacement() -> None:
    """A server that cuts a UTF-16 string between a surrogate pair sends each half as a JSON
    escape of its own. Passed on as they came, a lone half is no character: the SSE writer and
    msgpack refused it, and the answer failed with ``internal`` after its first tokens."""
    reading = _Reading("http://up", InferRequest(prompt="x"), budget=100)

    def texts(*contents: str, finish: str | None = None) -> list[str]:
        out = []
        for content in contents:
            choice: dict[str, object] = {"delta": {"content": content}}
            out += reading.event(json.dumps({"choices": [choice]}))
        if finish is not None:
            out += reading.event(json.dumps({"choices": [{"delta": {}, "finish_reason": finish}]}))
        return [chunk.text for chunk in out]

    assert texts("hi ", "\ud83d", "\ude00", " ok") == ["hi ", "\U0001f600", " ok"]
    assert texts("a\ude00b", "é\ud83d\ude00") == ["a\ufffdb", "é\U0001f600"]
    assert texts("end \ud83d", finish="stop") == ["end ", "\ufffd"]
    for text in texts("plain", "ünïcode ✓"):  # the usual tokens, untouched
        assert text in ("plain", "ünïcode ✓")
    assert reading.last().finish_reason == "stop"
