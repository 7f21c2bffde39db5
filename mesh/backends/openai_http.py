"""Backend for any OpenAI-compatible HTTP server (``vllm serve``, ``llama_cpp.server``, ...).

Chat requests stream from ``/chat/completions``, raw prompts from ``/completions``, over
server-sent events with aiohttp. Closing the generator closes the HTTP response, which vLLM
and llama_cpp.server take as an abort. An ``error`` event in the stream, or a stream that ends
before its finish reason, fails the generation: it is never passed on as a complete answer.
``response_format``, ``logprobs`` and ``top_logprobs`` pass through to the server.

Why not the official ``openai`` client: measured against the same server, it took 1.45 ms to the
first token where aiohttp took 0.31 ms, 5.2 ms for a whole 32-token stream against 0.65 ms, and
at 32 concurrent streams 80 ms to the first token against 12 ms (it validates every chunk into
a pydantic model on top of its own HTTP stack). The SSE parsing needed here is a few lines.

Capacity: when the server exposes vLLM's Prometheus ``/metrics``, the backend reads the engine's
running and waiting requests and its KV-cache use every ``metrics_interval`` seconds, and takes
no new work while the engine already queues requests or its cache is nearly full: the work
waits in JetStream, where any worker can take it, not in one engine's queue.

Continuing an answer another worker began uses vLLM's chat extension (the assistant's text so
far as the last message, ``continue_final_message``); with ``continuation=auto`` it is used when
the server's model list says vLLM owns the model, and other servers start the answer over.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import orjson

from mesh.backends.base import (
    MAX_ENGINE_PAUSE_S,
    SURROGATE,
    Capacity,
    Chunk,
    Health,
    engine_saturated,
    openai_logprobs,
    whole,
)
from mesh.backends.eager_send import EagerRequest
from mesh.config import ModelSettings
from mesh.logs import get_logger
from mesh.tasks import cancel_and_wait, raise_if_cancelled
from protocol.codec import LENIENT_OPENERS
from protocol.errors import BackendError, ContextTooLongError, MeshTimeoutError, UnavailableError
from protocol.messages import InferRequest, TokenLogprob, Usage

log = get_logger(__name__)
_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.MULTILINE)


def engine_load(text: str) -> dict[str, float] | None:
    """vLLM's own load from its Prometheus text: running and waiting requests summed over its
    engines (a data-parallel server has one label set each), and the fullest engine's KV-cache
    share, since the next request may land there. None when the text has no vLLM figures."""
    values: dict[str, list[float]] = {}
    for name, value in _METRIC.findall(text):
        values.setdefault(name, []).append(float(value))
    if not values:
        return None
    kv_cache = values.get("vllm:kv_cache_usage_perc") or values.get("vllm:gpu_cache_usage_perc")
    return {
        "running": sum(values.get("vllm:num_requests_running", [])),
        "waiting": sum(values.get("vllm:num_requests_waiting", [])),
        "kv_cache": max(kv_cache or [0.0]),
    }


class OpenAIHTTPBackend:
    continues = False

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.model = settings.name
        self._remote_model = settings.remote_model or settings.name
        self._base = settings.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._busy = 0
        self._full_until = 0.0
        """Till when (``time.monotonic()``) the engine said it is full (a 429 or 503 with
        ``Retry-After``): no slot is free meanwhile, so the worker pulls no work to refuse."""
        self.engine: dict[str, float] = {}
        """The engine's own load from its /metrics (empty when it exposes none)."""
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._session is not None:
            return
        headers = (
            {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}
        )
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.settings.http_timeout,
            sock_read=self.settings.http_timeout,
        )
        # A stream's reads have no timer of their own: aiohttp would set one again on every
        # token it reads; the generation's stall watchdog (``mesh.generate.coalesce``) stands
        # for it, one timer per answer.
        self._streaming = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.http_timeout, sock_read=None
        )
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0),  # the mesh limits concurrency (slots)
            request_class=EagerRequest,  # a request leaves in the call that makes it
        )
        mode = self.settings.continuation
        self.continues = mode == "vllm" or (mode == "auto" and await self._is_vllm())
        if await self._read_engine_metrics():
            self._poller = asyncio.get_running_loop().create_task(
                self._poll_engine(), name="engine-metrics"
            )

    async def _is_vllm(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self._base}/models") as resp:
                models = (await resp.json()).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return False  # cannot tell now: start answers over, never splice blindly
        return any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in models)

    async def _read_engine_metrics(self) -> bool:
        """Read vLLM's load from ``/metrics``; False when the server has none."""
        assert self._session is not None
        url = self._base.removesuffix("/v1") + "/metrics"
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    return False
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        load = engine_load(text)
        if load is None:
            return False
        self.engine = load
        return True

    async def _poll_engine(self) -> None:
        while True:
            await asyncio.sleep(self.settings.metrics_interval)
            raise_if_cancelled()
            if not await self._read_engine_metrics():
                self.engine = {}  # stale figures would starve the worker: go by slots alone

    async def close(self) -> None:
        if self._poller is not None:
            await cancel_and_wait([self._poller])
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def capacity(self) -> Capacity:
        full = engine_saturated(self.engine) or time.monotonic() < self._full_until
        free = 0 if full else max(0, self.settings.slots - self._busy)
        return Capacity(total=self.settings.slots, free=free, saturated=full)

    async def health(self) -> Health:
        if self._session is None:
            return Health(ok=False, detail="not started")
        try:
            # vLLM's and llama.cpp's server's own check (500 with a dead engine, 503 while a
            # model loads); a server without one answers 404, which says it is there.
            async with self._session.get(self._base.removesuffix("/v1") + "/health") as resp:
                return Health(ok=resp.status < 500, detail=f"GET /health -> {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Health(ok=False, detail=f"{type(exc).__name__}: {exc}")

    async def abort(self, request_id: str) -> None:
        return None  # closing the generator closes the response, which aborts on the server

    def _body(
        self, request: InferRequest, prefix: str, prefix_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self._remote_model,
            "max_tokens": max(1, request.max_tokens - prefix_tokens),
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.stop:
            body["stop"] = request.stop
        if request.seed is not None:
            body["seed"] = request.seed
        if request.response_format is not None and request.response_format.type != "text":
            body["response_format"] = request.response_format.model_dump(exclude_none=True)
        if request.raw:
            body["prompt"] = (request.prompt or "") + prefix
            if request.logprobs:
                body["logprobs"] = request.top_logprobs or 1
            return "/completions", body
        messages: list[dict[str, str]] = request.chat()
        if prefix:
            messages.append({"role": "assistant", "content": prefix})
            body.update(continue_final_message=True, add_generation_prompt=False)
        body["messages"] = messages
        if request.logprobs:
            body["logprobs"] = True
            if request.top_logprobs:
                body["top_logprobs"] = request.top_logprobs
        return "/chat/completions", body

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if self._session is None:
            raise BackendError("HTTP backend is not started", retryable=True)
        if prefix and not self.continues:
            raise ValueError("this server cannot continue an answer (continuation is off)")
        path, body = self._body(request, prefix, prefix_tokens)
        self._busy += 1
        reading = _Reading(self._base, request, budget=body["max_tokens"])
        try:
            async with self._session.post(
                self._base + path, json=body, timeout=self._streaming
            ) as resp:
                if resp.status != 200:
                    err = _http_error(resp, await resp.text(), request.id)
                    if err.retry_after is not None and resp.status in (429, 503):
                        wait = min(err.retry_after, MAX_ENGINE_PAUSE_S)
                        self._full_until = max(self._full_until, time.monotonic() + wait)
                    raise err
                # The events of each piece the connection hands over, with no async generator
                # or iterator between: one await per read (_SseLines).
                parser = _SseLines()
                read = resp.content.readany
                while piece := await read():
                    for data in parser.feed(piece):
                        for chunk in reading.event(data):
                            yield chunk
                    if reading.done:
                        break
                else:
                    for data in parser.close():
                        for chunk in reading.event(data):
                            yield chunk
            yield reading.last()
        except asyncio.TimeoutError:
            raise MeshTimeoutError(
                f"{self._base} sent nothing for {self.settings.http_timeout:g}s",
                request_id=request.id,
            ) from None
        except aiohttp.ClientError as exc:
            if reading.finish_reason is not None:  # cut after the answer ended: it is whole
                yield reading.last()
                return
            raise UnavailableError(
                f"{self._base} failed: {type(exc).__name__}: {exc}", request_id=request.id
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BackendError(
                f"{self._base} sent a malformed event: {exc}", request_id=request.id
            ) from None
        finally:
            self._busy -= 1


def parse_event(data: str) -> Any:
    """One event's JSON. orjson reads a token's event in under a third of the time ``json``
    takes (0.65 against 2.2 us for a 186-byte chunk), and a worker reads one per token. What it
    refuses (NaN, Infinity) goes to ``json``, which reads it as before or raises its
    ``JSONDecodeError`` (orjson's is a subclass). One difference stays: orjson reads an integer
    beyond 64 bits as a float (no engine counts tokens that high)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if data.count("[") + data.count("{") > LENIENT_OPENERS:  # json would recurse that deep
            raise json.JSONDecodeError(f"unreadable ({exc})", data, 0) from None
        try:
            return json.loads(data)
        except (RecursionError, ValueError) as err:  # an integer over 4,300 digits
            if isinstance(err, json.JSONDecodeError):
                raise
            raise json.JSONDecodeError(f"unreadable ({type(err).__name__})", data, 0) from None


class _Reading:
    """One generation's events, read: the chunks each one brings, and how it finished. Only
    the first choice is the answer (a server asked for one may send others: never spliced in),
    nothing after its finish reason is, and no more than ``budget`` engine tokens are: an
    engine that runs past ``max_tokens`` is cut there, finished ``length``."""

    def __init__(self, base: str, request: InferRequest, budget: int) -> None:
        self.base = base
        self.request = request
        self.budget = budget
        self.produced = 0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.done = False
        """``[DONE]`` came: the events after it (none, from a sound server) are not read."""
        self._high = ""
        """A UTF-16 high surrogate that ended the last text, held for the low one that the
        next event's text begins with (a server that cuts a UTF-16 string between a pair)."""

    def event(self, data: str) -> list[Chunk]:
        if data == "[DONE]" or self.done:
            self.done = True
            return []
        event = parse_event(data)
        if not isinstance(event, dict):
            raise BackendError(f"{self.base} sent a non-object event")
        request = self.request
        if event.get("error") or event.get("object") == "error":
            raise BackendError(
                f"{self.base} reported an error mid-stream: {_error_text(event)}",
                request_id=request.id,
            )
        if event.get("usage"):
            self.usage = self._usage(event["usage"])
        chunks: list[Chunk] = []
        choices = event.get("choices") or []
        if not isinstance(choices, list):
            raise self._malformed("choices")
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._malformed("a choice")
            if choice.get("index", 0) != 0 or self.finish_reason is not None:
                continue  # another choice's, or after the answer's finish
            text = self._text(choice)
            if text and self.produced >= self.budget:  # past max_tokens: cut, as the engine
                self.finish_reason, self.done = "length", True  # should have
                break
            if text:
                logprobs = self._logprobs(choice) if request.logprobs else None
                n = len(logprobs) if logprobs else 1  # an event may carry several tokens
                self.produced += n
                if self._high or (not text.isascii() and SURROGATE.search(text)):
                    text = self._mend(text)
                if text or logprobs:
                    chunks.append(Chunk(text=text, n=n, logprobs=logprobs))
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
                if self._high:  # a half whose other half never came
                    chunks.append(Chunk(text="\ufffd"))
                    self._high = ""
        return chunks

    def _text(self, choice: dict[str, Any]) -> str | None:
        if self.request.raw:
            text = choice.get("text")
        else:
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise self._malformed("a delta")
            text = delta.get("content")
        if text is not None and not isinstance(text, str):
            raise self._malformed("a text")
        return text

    def _usage(self, usage: Any) -> Usage:
        """The engine's counts; one it cannot mean (negative, not a number) is not passed on:
        what was counted here stands in."""
        if not isinstance(usage, dict):
            raise self._malformed("usage")

        def count(name: str, counted: int) -> int:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
            return counted

        return Usage(
            prompt_tokens=count("prompt_tokens", 0),
            completion_tokens=count("completion_tokens", self.produced),
        )

    def _logprobs(self, choice: dict[str, Any]) -> list[TokenLogprob] | None:
        found = choice.get("logprobs")
        if not isinstance(found, dict):
            return None
        try:
            return openai_logprobs(found, chat=not self.request.raw, top=self.request.top_logprobs)
        except (KeyError, TypeError, ValueError, AttributeError):  # pydantic's is a ValueError
            raise self._malformed("logprobs") from None

    def _malformed(self, what: str) -> BackendError:
        return BackendError(f"{self.base} sent a malformed event: {what} of the wrong type")

    def _mend(self, text: str) -> str:
        """``text`` with its surrogate pairs joined (one cut between events too) and a lone
        half as U+FFFD: a lone surrogate is no character, and no UTF-8 writer (an SSE stream,
        msgpack) takes one; the answer failed with it."""
        text, self._high = self._high + text, ""
        if "\ud800" <= text[-1] <= "\udbff":
            text, self._high = text[:-1], text[-1]
        return whole(text)

    def last(self) -> Chunk:
        """The finishing chunk; raises when the stream ended before the answer did."""
        if self.finish_reason is None:
            # Cut off mid-answer (the server restarted, or interrupted us for another
            # request, as llama_cpp.server does): never pass a truncated answer as complete.
            raise BackendError(
                f"{self.base} ended the stream before the answer was complete",
                request_id=self.request.id,
            )
        return Chunk(
            finish_reason=self.finish_reason,
            usage=self.usage or Usage(completion_tokens=self.produced),
        )


class _SseLines:
    """Pieces of a server-sent event stream in, the ``data:`` payloads of the events they
    complete out (multi-line data joined with newlines, as the SSE spec has it; lines end in
    LF, CRLF or CR). A piece is whatever the connection has (one await per read, not per line:
    a token's event is two lines). A CRLF cut in two ends one line, and a multi-byte character
    is never cut (line ends are ASCII)."""

    def __init__(self) -> None:
        self._pending = b""  # a line not ended yet
        self._after_cr = False  # the last piece ended in CR: a LF first ends no other line
        self._data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        if (  # the usual piece: one whole event of one data line, nothing pending
            piece[-2:] == b"\n\n"
            and not self._pending
            and not self._data
            and not self._after_cr
            and piece.startswith(b"data:")
            and piece.count(b"\n") == 2
            and b"\r" not in piece
        ):
            return [piece[5:-2].decode("utf-8").removeprefix(" ")]
        if self._after_cr and piece.startswith(b"\n"):
            piece = piece[1:]  # the LF of a CRLF cut in two: that line has ended
        self._after_cr = piece.endswith(b"\r")
        if b"\r" in piece:
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        pending = self._pending + piece
        cut = pending.rfind(b"\n")
        if cut < 0:
            self._pending = pending
            return []
        block, self._pending = pending[:cut], pending[cut + 1 :]
        return self._events(block)

    def close(self) -> list[str]:
        """What is left at the end of the stream (its last line may have no end)."""
        events = self._events(self._pending) if self._pending else []
        if self._data:
            events.append("\n".join(self._data))
        return events

    def _events(self, block: bytes) -> list[str]:
        """Takes the LF-separated lines of ``block`` (its final line end cut off); the events
        they end."""
        events: list[str] = []
        for line in block.decode("utf-8").split("\n"):
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                self._data.append(line[5:].removeprefix(" "))
        return events


def _error_text(event: dict[str, Any]) -> str:
    error = event.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error or event.get("message") or event)[:300]


def _http_error(
    resp: aiohttp.ClientResponse, body: str, request_id: str
) -> BackendError | ContextTooLongError:
    status = resp.status
    snippet = body[:300]
    if status == 400 and ("context" in body.lower() or "too long" in body.lower()):
        return ContextTooLongError(f"server rejected the prompt: {snippet}", request_id=request_id)
    return BackendError(
        f"server answered HTTP {status}: {snippet}",
        request_id=request_id,
        retryable=status >= 500 or status == 429,
        retry_after=_retry_after(resp.headers.get("Retry-After")),
    )


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (its HTTP-date form is not read: None, as without one)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < 3600 else None
