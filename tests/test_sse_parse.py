"""The OpenAI-compatible backend's server-sent-event parser: whatever pieces the connection hands
over (a CRLF or a multi-byte character cut in two, several events at once, one byte at a time),
the same ``data:`` payloads in the same order."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from mesh.backends.openai_http import _sse_data

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


class _Content:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


class _Response:
    def __init__(self, pieces: list[bytes]) -> None:
        self.content = _Content(pieces)


async def _parse(pieces: list[bytes]) -> list[str]:
    resp: Any = _Response(pieces)
    return [data async for data in _sse_data(resp)]


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
