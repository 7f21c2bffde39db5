"""Backend for any OpenAI-compatible HTTP server (``vllm serve``, ``llama_cpp.server``, ...).

Streams ``/chat/completions`` over server-sent events with aiohttp. Closing the generator closes
the HTTP response, which vLLM and llama_cpp.server take as an abort. An ``error`` event in the
stream, or a stream that ends before its finish reason, fails the generation: it is never
passed on as a complete answer.

Continuing an answer another worker began uses vLLM's chat extension (the assistant's text so
far as the last message, ``continue_final_message``); with ``continuation=auto`` it is used when
the server's model list says vLLM owns the model, and other servers start the answer over.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import aiohttp

from mesh.backends.base import Capacity, Chunk, Health
from mesh.config import ModelSettings
from mesh.logs import get_logger
from protocol.errors import BackendError, ContextTooLongError, MeshTimeoutError, UnavailableError
from protocol.messages import InferRequest, Usage

log = get_logger(__name__)


class OpenAIHTTPBackend:
    continues = False

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.model = settings.name
        self._remote_model = settings.remote_model or settings.name
        self._base = settings.base_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._busy = 0

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
        self._session = aiohttp.ClientSession(headers=headers, timeout=timeout)
        mode = self.settings.continuation
        self.continues = mode == "vllm" or (mode == "auto" and await self._is_vllm())

    async def _is_vllm(self) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{self._base}/models") as resp:
                models = (await resp.json()).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return False  # cannot tell now: start answers over, never splice blindly
        return any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in models)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def capacity(self) -> Capacity:
        return Capacity(total=self.settings.slots, free=max(0, self.settings.slots - self._busy))

    async def health(self) -> Health:
        if self._session is None:
            return Health(ok=False, detail="not started")
        try:
            async with self._session.get(f"{self._base}/models") as resp:
                return Health(ok=resp.status == 200, detail=f"GET /models -> {resp.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Health(ok=False, detail=f"{type(exc).__name__}: {exc}")

    async def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _body(self, request: InferRequest, prefix: str, prefix_tokens: int) -> dict[str, Any]:
        messages: list[dict[str, str]] = request.chat()
        body: dict[str, Any] = {
            "model": self._remote_model,
            "messages": messages,
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
        if prefix:
            messages.append({"role": "assistant", "content": prefix})
            body.update(continue_final_message=True, add_generation_prompt=False)
        return body

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if self._session is None:
            raise BackendError("HTTP backend is not started", retryable=True)
        if prefix and not self.continues:
            raise ValueError("this server cannot continue an answer (continuation is off)")
        current = asyncio.current_task()
        if current is not None:
            self._tasks[request.id] = current
        self._busy += 1
        completion_tokens = 0
        finish_reason: str | None = None
        usage: Usage | None = None
        done = False
        try:
            async with self._session.post(
                f"{self._base}/chat/completions", json=self._body(request, prefix, prefix_tokens)
            ) as resp:
                if resp.status != 200:
                    raise _http_error(resp.status, await resp.text(), request.id)
                async for data in _sse_data(resp):
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if not isinstance(event, dict):
                        raise BackendError(f"{self._base} sent a non-object event")
                    if event.get("error") or event.get("object") == "error":
                        raise BackendError(
                            f"{self._base} reported an error mid-stream: {_error_text(event)}",
                            request_id=request.id,
                        )
                    if event.get("usage"):
                        usage = Usage(
                            prompt_tokens=event["usage"].get("prompt_tokens", 0),
                            completion_tokens=event["usage"].get("completion_tokens", 0),
                        )
                    for choice in event.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content")
                        if text:
                            completion_tokens += 1
                            yield Chunk(text=text)
                        if choice.get("finish_reason"):
                            finish_reason = choice["finish_reason"]
            if not done and finish_reason is None:
                # Cut off mid-answer (server restarted, or it interrupted us for another
                # request, as llama_cpp.server does): never pass a truncated answer as complete.
                raise BackendError(
                    f"{self._base} ended the stream before the answer was complete",
                    request_id=request.id,
                )
            yield Chunk(
                finish_reason=finish_reason or "stop",
                usage=usage or Usage(completion_tokens=completion_tokens),
            )
        except asyncio.TimeoutError:
            raise MeshTimeoutError(
                f"{self._base} sent nothing for {self.settings.http_timeout:g}s",
                request_id=request.id,
            ) from None
        except aiohttp.ClientError as exc:
            raise UnavailableError(
                f"{self._base} failed: {type(exc).__name__}: {exc}", request_id=request.id
            ) from None
        except json.JSONDecodeError as exc:
            raise BackendError(
                f"{self._base} sent a malformed event: {exc}", request_id=request.id
            ) from None
        finally:
            self._busy -= 1
            self._tasks.pop(request.id, None)


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream (one JSON document per event)."""
    buffer: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if buffer:
                yield "\n".join(buffer)
                buffer = []
        elif line.startswith("data:"):
            buffer.append(line[5:].lstrip())
    if buffer:
        yield "\n".join(buffer)


def _error_text(event: dict[str, Any]) -> str:
    error = event.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error or event.get("message") or event)[:300]


def _http_error(status: int, body: str, request_id: str) -> BackendError | ContextTooLongError:
    snippet = body[:300]
    if status == 400 and ("context" in body.lower() or "too long" in body.lower()):
        return ContextTooLongError(f"server rejected the prompt: {snippet}", request_id=request_id)
    return BackendError(
        f"server answered HTTP {status}: {snippet}",
        request_id=request_id,
        retryable=status >= 500 or status == 429,
    )
