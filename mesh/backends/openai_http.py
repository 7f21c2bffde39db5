"""Backend for any OpenAI-compatible HTTP server (``vllm serve``, ``llama_cpp.server``, ...),
through the official ``openai`` client (the ``worker`` extra).

Chat requests stream from ``/chat/completions``, raw prompts from ``/completions``; closing the
generator closes the HTTP response, which vLLM and llama_cpp.server take as an abort. An
``error`` event in the stream, or a stream that ends before its finish reason, fails the
generation: it is never passed on as a complete answer. ``response_format``, ``logprobs`` and
``top_logprobs`` pass through to the server.

Continuing an answer another worker began uses vLLM's chat extension (the assistant's text so
far as the last message, ``continue_final_message``); with ``continuation=auto`` it is used when
the server's model list says vLLM owns the model, and other servers start the answer over.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import openai

from mesh.backends.base import Capacity, Chunk, Health
from mesh.config import ModelSettings
from mesh.logs import get_logger
from protocol.errors import (
    BackendError,
    ContextTooLongError,
    MeshError,
    MeshTimeoutError,
    UnavailableError,
)
from protocol.messages import InferRequest, TokenLogprob, Usage

log = get_logger(__name__)


class OpenAIHTTPBackend:
    continues = False

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.model = settings.name
        self._remote_model = settings.remote_model or settings.name
        self._base = settings.base_url.rstrip("/")
        self._client: openai.AsyncOpenAI | None = None
        self._busy = 0

    async def start(self) -> None:
        if self._client is not None:
            return
        timeout = openai.Timeout(self.settings.http_timeout)  # connect, read, write, pool
        self._client = openai.AsyncOpenAI(
            base_url=self._base,
            api_key=self.settings.api_key or "unused",
            timeout=timeout,
            max_retries=0,  # retrying is the mesh's job (redelivery, with continuation)
        )
        mode = self.settings.continuation
        self.continues = mode == "vllm" or (mode == "auto" and await self._is_vllm())

    async def _is_vllm(self) -> bool:
        assert self._client is not None
        try:
            models = await self._client.models.list()
        except openai.OpenAIError:
            return False  # cannot tell now: start answers over, never splice blindly
        return any(getattr(m, "owned_by", None) == "vllm" for m in models.data)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def capacity(self) -> Capacity:
        return Capacity(total=self.settings.slots, free=max(0, self.settings.slots - self._busy))

    async def health(self) -> Health:
        if self._client is None:
            return Health(ok=False, detail="not started")
        try:
            await self._client.models.list()
        except openai.OpenAIError as exc:
            return Health(ok=False, detail=f"{type(exc).__name__}: {exc}")
        return Health(ok=True, detail=f"{self._base}: {self._busy}/{self.settings.slots} busy")

    async def abort(self, request_id: str) -> None:
        return None  # closing the generator closes the response, which aborts on the server

    def _common(self, request: InferRequest, prefix_tokens: int) -> dict[str, Any]:
        options: dict[str, Any] = {
            "model": self._remote_model,
            "max_tokens": max(1, request.max_tokens - prefix_tokens),
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.stop:
            options["stop"] = request.stop
        if request.seed is not None:
            options["seed"] = request.seed
        return options

    async def _open(self, request: InferRequest, prefix: str, prefix_tokens: int) -> Any:
        assert self._client is not None
        options = self._common(request, prefix_tokens)
        if request.raw:
            if request.logprobs:
                options["logprobs"] = request.top_logprobs or 1
            if request.response_format is not None and request.response_format.type != "text":
                options["extra_body"] = {
                    "response_format": request.response_format.model_dump(exclude_none=True)
                }
            return await self._client.completions.create(
                prompt=(request.prompt or "") + prefix, **options
            )
        messages: list[dict[str, str]] = request.chat()
        if prefix:
            messages.append({"role": "assistant", "content": prefix})
            options["extra_body"] = {"continue_final_message": True, "add_generation_prompt": False}
        if request.logprobs:
            options.update(logprobs=True, top_logprobs=request.top_logprobs or None)
        if request.response_format is not None and request.response_format.type != "text":
            options["response_format"] = request.response_format.model_dump(exclude_none=True)
        return await self._client.chat.completions.create(messages=messages, **options)  # type: ignore[arg-type]

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        if self._client is None:
            raise BackendError("HTTP backend is not started", retryable=True)
        if prefix and not self.continues:
            raise ValueError("this server cannot continue an answer (continuation is off)")
        self._busy += 1
        produced = 0
        finish_reason: str | None = None
        usage: Usage | None = None
        try:
            stream = await self._open(request, prefix, prefix_tokens)
            try:
                async for event in stream:
                    if event.usage:
                        usage = Usage(
                            prompt_tokens=event.usage.prompt_tokens or 0,
                            completion_tokens=event.usage.completion_tokens or 0,
                        )
                    for choice in event.choices or []:
                        text = choice.text if request.raw else choice.delta.content
                        if text:
                            produced += 1
                            logprobs = _logprobs(choice, request) if request.logprobs else None
                            yield Chunk(text=text, logprobs=logprobs)
                        if choice.finish_reason:
                            finish_reason = choice.finish_reason
            finally:
                await stream.close()
            if finish_reason is None:
                # Cut off mid-answer (the server restarted, or interrupted us for another
                # request, as llama_cpp.server does): never pass a truncated answer as complete.
                raise BackendError(
                    f"{self._base} ended the stream before the answer was complete",
                    request_id=request.id,
                )
            yield Chunk(
                finish_reason=finish_reason, usage=usage or Usage(completion_tokens=produced)
            )
        except openai.APITimeoutError:
            raise MeshTimeoutError(
                f"{self._base} sent nothing for {self.settings.http_timeout:g}s",
                request_id=request.id,
            ) from None
        except openai.APIConnectionError as exc:
            raise UnavailableError(f"{self._base} failed: {exc}", request_id=request.id) from None
        except openai.APIStatusError as exc:
            raise _status_error(exc, request.id) from None
        except openai.APIError as exc:  # an error event in the stream
            raise BackendError(
                f"{self._base} reported an error mid-stream: {exc.message}", request_id=request.id
            ) from None
        finally:
            self._busy -= 1


def _logprobs(choice: Any, request: InferRequest) -> list[TokenLogprob] | None:
    found = getattr(choice, "logprobs", None)
    if found is None:
        return None
    top = request.top_logprobs
    if request.raw:  # completions: parallel lists
        tokens = found.tokens or []
        tops = found.top_logprobs or [None] * len(tokens)
        return [
            TokenLogprob(
                token=token,
                logprob=float(lp),
                top=[(t, float(v)) for t, v in (alts or {}).items()][:top] if top else None,
            )
            for token, lp, alts in zip(tokens, found.token_logprobs or [], tops, strict=False)
            if lp is not None
        ]
    return [
        TokenLogprob(
            token=entry.token,
            logprob=float(entry.logprob),
            top=[(t.token, float(t.logprob)) for t in entry.top_logprobs or []] if top else None,
        )
        for entry in found.content or []
    ]


def _status_error(exc: openai.APIStatusError, request_id: str) -> MeshError:
    body = str(exc.body or exc.message)[:300]
    status = exc.status_code
    if status == 400 and ("context" in body.lower() or "too long" in body.lower()):
        return ContextTooLongError(f"server rejected the prompt: {body}", request_id=request_id)
    return BackendError(
        f"server answered HTTP {status}: {body}",
        request_id=request_id,
        retryable=status >= 500 or status == 429,
    )
