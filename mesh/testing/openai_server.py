"""A deterministic OpenAI-compatible HTTP server, for tests and benchmarks. Not a model server.

    python -m mesh.testing.openai_server --port 8000 [--prefill-ms 50] [--token-ms 20]

It answers ``POST /v1/chat/completions`` (streamed or not) with the script of
:mod:`mesh.backends.deterministic`: ``max_tokens`` tokens ``" <tag>0 <tag>1 ..."``, with the
same prompt directives for hangs and failures, plus ``[sse-error-after:K]`` (an SSE ``error``
event after K tokens, then ``[DONE]``, as some servers do). Like vLLM, it continues an answer
when the last message is the assistant's and ``continue_final_message`` is set. It prints
``listening on <port>`` once it accepts connections. ``/metrics`` reports its load the way
vLLM's Prometheus metrics name it; ``--engine-slots N`` makes requests beyond N wait, as an
engine at its batch limit does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from mesh.backends.deterministic import Script, prompt_tokens, token_logprob, tokens
from mesh.config import ModelSettings
from protocol.errors import BackendError
from protocol.messages import InferRequest


def _request(body: dict[str, Any], chat: bool) -> tuple[InferRequest, str]:
    max_tokens = int(body.get("max_tokens") or 16)
    if not chat:  # a raw prompt; a continuation is the prompt with the kept text appended
        prompt = str(body.get("prompt") or "")
        return InferRequest(prompt=prompt, raw=True, max_tokens=max_tokens), ""
    messages = list(body.get("messages") or [])
    prefix = ""
    if body.get("continue_final_message") and messages and messages[-1]["role"] == "assistant":
        prefix = messages.pop()["content"]
    request = InferRequest(messages=messages, max_tokens=max_tokens, model=body.get("model"))
    return request, prefix


class DeterministicServer:
    def __init__(
        self,
        name: str,
        prefill_ms: float,
        token_ms: float,
        engine_slots: int = 0,
        *,
        lockstep: bool = False,
    ) -> None:
        self.name = name
        self.settings = ModelSettings(
            name=name, prefill_delay_ms=prefill_ms, token_delay_ms=token_ms, token_lockstep=lockstep
        )
        self.requests = 0
        self.running = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(engine_slots) if engine_slots else None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, _request: web.Request) -> web.Response:
        """The engine's load, named as vLLM's Prometheus metrics are."""
        lines = [
            f'vllm:num_requests_running{{model_name="{self.name}"}} {self.running}',
            f'vllm:num_requests_waiting{{model_name="{self.name}"}} {self.waiting}',
            f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} 0.0',
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.name, "owned_by": "mesh-deterministic"}]}
        )

    async def chat(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, chat=True)

    async def completions(self, http: web.Request) -> web.StreamResponse:
        return await self._answer(http, chat=False)

    async def _answer(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        self.requests += 1
        if self._slots is None:
            return await self._generate(http, chat=chat)
        self.waiting += 1  # like an engine at its batch limit: queue until a slot is free
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            return await self._generate(http, chat=chat)
        finally:
            self._slots.release()

    async def _generate(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        self.running += 1
        try:
            return await self._stream(http, chat=chat)
        finally:
            self.running -= 1

    async def _stream(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await http.json()
        request, prefix = _request(body, chat)
        script = Script.of(request)
        if not chat:
            prefix = "".join(script.token(i) for i in range(_kept(request.text(), script)))
        top = _top(body, chat)
        start = len(prefix.split())  # the prefix is tokens " <tag>0 ... <tag>k-1"
        total = start + request.max_tokens  # max_tokens counts only what is still to come
        if not body.get("stream"):
            text = "".join(
                [script.token(i) async for i in tokens(script, total, start, self.settings)]
            )
            return web.json_response(self._completion(text, request, total - start, chat))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http)
        produced = 0
        created = int(time.time())
        try:
            async for index in tokens(script, total, start, self.settings):
                if script.sse_error_after is not None and index >= script.sse_error_after:
                    error = {"message": "scripted failure mid-stream", "type": "server_error"}
                    await self._event(response, {"error": error})
                    await response.write(b"data: [DONE]\n\n")
                    return response
                produced += 1
                token = script.token(index)
                logprobs = _logprobs(token, index, top, chat) if top is not None else None
                await self._event(response, self._chunk(created, token, None, chat, logprobs))
        except BackendError as exc:
            await self._event(response, {"error": {"message": exc.message}})
            await response.write(b"data: [DONE]\n\n")
            return response
        last = total if script.stop_after is None else min(total, script.stop_after)
        finish = "length" if last >= total else "stop"
        await self._event(response, self._chunk(created, None, finish, chat))
        usage = {"prompt_tokens": prompt_tokens(request), "completion_tokens": produced}
        final = {**self._chunk(created, None, None, chat), "choices": [], "usage": usage}
        await self._event(response, final)
        await response.write(b"data: [DONE]\n\n")
        return response

    def _chunk(
        self,
        created: int,
        text: str | None,
        finish: str | None,
        chat: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:8]}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.name,
            "choices": [choice],
        }

    def _completion(
        self, text: str, request: InferRequest, produced: int, chat: bool
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:8]}",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.name,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens(request), "completion_tokens": produced},
        }

    @staticmethod
    async def _event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())


def _kept(text: str, script: Script) -> int:
    """How many tokens of the script end a raw prompt: a continuation appends the kept text
    (`` <tag>0 ... <tag>k-1``) to the prompt."""
    words = text.split()
    for k in range(len(words), 0, -1):
        if words[-k:] == [script.token(i).strip() for i in range(k)]:
            return k
    return 0


def _top(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the body asks for (None: no logprobs)."""
    if chat:
        return int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    value = body.get("logprobs")
    return None if value is None else int(value)


def _logprobs(token: str, index: int, top: int, chat: bool) -> dict[str, Any]:
    entry = token_logprob(token, index, top)
    alternatives = entry.top or []
    if chat:
        return {
            "content": [
                {
                    "token": token,
                    "logprob": entry.logprob,
                    "bytes": None,
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": None} for t, lp in alternatives
                    ],
                }
            ]
        }
    return {
        "tokens": [token],
        "token_logprobs": [entry.logprob],
        "top_logprobs": [dict(alternatives)] if top else None,
        "text_offset": [0],
    }


async def serve(  # noqa: PLR0917 - the command line's options
    port: int,
    name: str,
    prefill_ms: float,
    token_ms: float,
    engine_slots: int = 0,
    lockstep: bool = False,
) -> None:
    server = DeterministicServer(name, prefill_ms, token_ms, engine_slots, lockstep=lockstep)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"listening on {bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefill-ms", type=float, default=0.0)
    parser.add_argument("--token-ms", type=float, default=0.0)
    parser.add_argument(
        "--engine-slots", type=int, default=0, help="generate at most this many at once (0: any)"
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="every answer's tokens on one clock, as a batching engine steps them all at once",
    )
    args = parser.parse_args()
    asyncio.run(
        serve(
            args.port, args.model, args.prefill_ms, args.token_ms, args.engine_slots, args.lockstep
        )
    )


if __name__ == "__main__":
    main()
