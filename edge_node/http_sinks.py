"""What an HTTP request's answer goes into at the edge: gathered whole, or streamed as
OpenAI's server-sent events, and the error body both use."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from edge_node.openai_api import Shaper, mesh_fields
from mesh.tasks import raise_if_cancelled
from protocol.codec import compact_json, error_event, to_exception
from protocol.errors import ErrorCode, IncompleteAnswerError, MeshError
from protocol.messages import EndEvent, ErrorEvent, InferRequest, StartEvent, TokenEvent, WireEvent
from protocol.stream import AnswerState, starts_over

CLIENT_STALL_S = 10.0
"""How long a streaming client's full socket may hold an event back before the client is taken
for gone (it stopped reading): the connection is closed and the request cancelled, so that it
does not hold its place at the edge for as long as the client keeps the connection open."""
PIECE = 16 * 1024
"""How much of a whole answer is written at a time (:func:`send_whole`)."""


def error_body(err: MeshError) -> dict[str, Any]:
    """OpenAI's error object, with the mesh's stable code as its type and code."""
    return {
        "error": {
            "message": err.message,
            "type": err.code.value,
            "code": err.code.value,
            "param": (err.details or [{}])[0].get("loc"),
            "retryable": err.retryable,
        }
    }


async def patiently(request: web.Request, write: Awaitable[None]) -> None:
    """A write, waited for while the client reads, however slowly; when its socket is full and
    stays full for ``CLIENT_STALL_S``, the client is taken for gone (it stopped reading): the
    connection is closed, and aiohttp cancels the request's handler."""
    transport = request.transport
    if transport is None or not transport.get_write_buffer_size():
        await write  # the socket takes it: nothing to time (the hot path)
        return
    try:
        await asyncio.wait_for(write, CLIENT_STALL_S)
    except asyncio.TimeoutError:
        raise_if_cancelled()
        transport.abort()
        raise MeshError(f"HTTP client stopped reading for {CLIENT_STALL_S:g}s") from None


async def send_whole(
    request: web.Request, body: dict[str, Any], headers: dict[str, str]
) -> web.StreamResponse:
    """A whole JSON answer, in pieces small enough that a write into an empty socket does not
    wait (aiohttp waits past 64 KiB), each with :func:`patiently`'s patience: aiohttp's
    ``json_response`` waited for a client that stopped reading without end, holding the
    connection and the answer (5 MB in the test) for as long as the client kept it open."""
    data = json.dumps(body).encode()
    response = web.StreamResponse(
        headers={**headers, "Content-Type": "application/json; charset=utf-8"}
    )
    response.content_length = len(data)
    await response.prepare(request)
    with contextlib.suppress(MeshError, ConnectionError, RuntimeError):  # the client went
        for at in range(0, len(data), PIECE):
            await patiently(request, response.write(data[at : at + PIECE]))
        await patiently(request, response.write_eof())
    return response


class CollectSink:
    """Gathers a whole answer (and its logprobs) for a non-streaming HTTP request."""

    streaming = False
    takes_tokens_now = True

    def __init__(self, request_id: str) -> None:
        self.answer = AnswerState(request_id)

    async def send(self, event: WireEvent) -> None:
        self.answer.feed(event)

    def send_now(self, event: TokenEvent) -> None:
        self.answer.feed(event)

    def send_token(self, seq: int, text: str, attempt: int, n: int) -> None:
        self.answer.feed_token(attempt, seq, text, n)


class SSESink:
    """Streams the OpenAI chunks of one answer. The HTTP response starts with the first event,
    so an error before any token is still a proper HTTP status. SSE cannot take text back: an
    answer that starts over after text went out ends this stream in a typed error."""

    streaming = True
    takes_back = False

    def __init__(self, request: web.Request, req: InferRequest, shaper: Shaper, usage: bool):
        self._request = request
        self._req = req
        self._shaper = shaper
        self._usage = usage
        self.response: web.StreamResponse | None = None
        self.sent = 0
        self.closed = False
        self.last_error: ErrorEvent | None = None

    async def _send(self, payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        try:
            event = f"data: {data}\n\n".encode()
        except UnicodeEncodeError:  # a lone surrogate (an engine's error text): escaped
            event = f"data: {json.dumps(payload)}\n\n".encode()
        await self._write(event)

    async def _write(self, event: bytes) -> None:
        """One server-sent event, encoded."""
        if self.response is None:
            self.response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": self._req.id,
                }
            )
            await self.response.prepare(self._request)
        try:
            await self._patiently(self.response.write(event))
        except (ConnectionError, RuntimeError) as exc:
            self.closed = True
            raise MeshError(f"HTTP client gone: {type(exc).__name__}") from None

    async def _patiently(self, write: Awaitable[None]) -> None:
        try:
            await patiently(self._request, write)
        except MeshError:
            self.closed = True
            raise

    async def finish(self) -> None:
        """The stream's end, written with the same patience as its events (aiohttp's own
        ``write_eof`` waits for a full socket without end)."""
        if self.response is not None:
            with contextlib.suppress(MeshError, ConnectionError, RuntimeError):
                await self._patiently(self.response.write_eof())

    async def send(self, event: WireEvent) -> None:
        if self.closed:
            return
        if isinstance(event, TokenEvent):
            chunk = self._shaper.chunk(event.text, first=self.sent == 0, logprobs=event.logprobs)
            self.sent += 1
            try:  # no floats in it: orjson's compact JSON (compact_json)
                data = None if event.logprobs is not None else compact_json(chunk)
            except UnicodeEncodeError:  # a lone surrogate: escaped (_send)
                data = None
            if data is not None:
                await self._write(b"data: " + data + b"\n\n")
            else:
                await self._send(chunk)
        elif isinstance(event, StartEvent):
            if starts_over(event, self.sent):
                why = event.reason or "a worker stopped"
                await self._fail(
                    IncompleteAnswerError(
                        f"the answer started over after streaming began ({why}); retry",
                        request_id=self._req.id,
                    )
                )
        elif isinstance(event, EndEvent):
            final = self._shaper.chunk(None, first=self.sent == 0, finish=event.finish_reason)
            final["mesh"] = mesh_fields(event)
            await self._send(final)
            if self._usage:
                await self._send(self._shaper.usage_chunk(event))
            await self._send("[DONE]")
            self.closed = True
        else:
            await self._fail(to_exception(event))

    async def crashed(self) -> None:
        """The stream's typed end after the edge failed while writing it (best effort)."""
        if not self.closed:
            with contextlib.suppress(Exception):
                await self._fail(MeshError("edge failure", code=ErrorCode.INTERNAL))
        self.closed = True

    async def _fail(self, error: MeshError) -> None:
        self.last_error = error_event(error, self._req.id)
        if self.response is None:
            self.closed = True
            return  # the handler answers with a plain HTTP error
        await self._send(error_body(error))
        await self._send("[DONE]")
        self.closed = True
