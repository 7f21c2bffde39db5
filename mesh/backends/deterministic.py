"""A deterministic backend for tests and benchmarks. Not an inference engine.

It answers every request with ``max_tokens`` tokens ``" <tag>0 <tag>1 ..."``, where the tag
comes from a ``[tag:NAME]`` directive in the prompt (``t`` by default). Because the whole answer
follows from the request, a test can check every answer exactly, under any fault, and two
requests' answers never look alike when their tags differ.

It continues an answer exactly: given a prefix of k tokens it produces tokens k, k+1, ...

Directives in the prompt shape its behaviour, for fault tests:

- ``[tag:NAME]``: the token stem;
- ``[hang]``: never produce a token; ``[hang-after:K]``: hang after K tokens;
- ``[fail-after:K]``: a retryable engine failure after K tokens;
- ``[stop-after:K]``: finish with ``stop`` after K tokens;
- ``[sse-error-after:K]``: (HTTP server only) an SSE ``error`` event after K tokens, then
  ``[DONE]``, as some OpenAI-compatible servers do;
- ``[unsure]``: scored generation (:meth:`DeterministicBackend.generate_scored`) reports every
  token drawn with entropy 4.0 nats and top log-probability -2.0; otherwise 0.5 and -0.1.

``prefill_delay_ms`` and ``token_delay_ms`` in the model settings pace it like an engine
(``token_lockstep``: like a batching engine, every answer's next token at the same step);
``faults=false`` makes it ignore the fault directives (an edge's local engine in fault tests).
Asked for logprobs, token i gets log probability ``-(i % 10 + 1) / 10`` (alternatives: the
same stem with a ``*``, each 1 lower). It ignores ``response_format``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from mesh.backends.base import Capacity, Chunk, Health
from mesh.config import ModelSettings
from protocol.errors import BackendError
from protocol.messages import InferRequest, TokenLogprob, Usage

_DIRECTIVE = re.compile(
    r"\[(tag|hang|hang-after|fail-after|stop-after|sse-error-after)(?::([\w-]+))?\]"
)
UNSURE = (4.0, -2.0)
SURE = (0.5, -0.1)


@dataclass(frozen=True)
class Script:
    """What the deterministic engine does for one request."""

    tag: str = "t"
    hang_after: int | None = None
    fail_after: int | None = None
    stop_after: int | None = None
    sse_error_after: int | None = None

    @classmethod
    def of(cls, request: InferRequest, *, faults: bool = True) -> Script:
        found: dict[str, str | None] = {}
        for name, value in _DIRECTIVE.findall(request.text()):
            found[name] = value or None

        def count(name: str) -> int | None:
            if name not in found:
                return None
            value = found[name]
            return int(value) if value and value.isdigit() else 0

        hang = 0 if "hang" in found else count("hang-after")
        if not faults:
            return cls(tag=found.get("tag") or "t", stop_after=count("stop-after"))
        return cls(
            tag=found.get("tag") or "t",
            hang_after=hang,
            fail_after=count("fail-after"),
            stop_after=count("stop-after"),
            sse_error_after=count("sse-error-after"),
        )

    def token(self, index: int) -> str:
        return f" {self.tag}{index}"

    def last(self, max_tokens: int) -> int:
        """One past the last token index the answer has."""
        return max_tokens if self.stop_after is None else min(max_tokens, self.stop_after)

    def answer(self, max_tokens: int) -> str:
        """The whole answer a request gets."""
        return "".join(self.token(i) for i in range(self.last(max_tokens)))


def token_logprob(text: str, index: int, top: int) -> TokenLogprob:
    """The deterministic log probability of token ``index`` and its ``top`` alternatives."""
    logprob = -((index % 10) + 1) / 10
    alternatives = [(text, logprob)] + [(f"{text}{'*' * k}", logprob - k) for k in range(1, top)]
    return TokenLogprob(token=text, logprob=logprob, top=alternatives[:top] if top else None)


def _chunk(script: Script, index: int, request: InferRequest) -> Chunk:
    text = script.token(index)
    if request.logprobs:
        return Chunk(text, logprobs=[token_logprob(text, index, request.top_logprobs)])
    return Chunk(text)


def prompt_tokens(request: InferRequest) -> int:
    return sum(len(m["content"].split()) + 3 for m in request.chat())


class DeterministicBackend:
    """The deterministic test backend (see the module docstring)."""

    continues = True

    def __init__(self, settings: ModelSettings) -> None:
        self.settings = settings
        self.model = settings.name
        self._busy = 0
        self.started = 0
        """Generations begun (tests count how often a request really ran)."""

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def capacity(self) -> Capacity:
        return Capacity(total=self.settings.slots, free=max(0, self.settings.slots - self._busy))

    async def health(self) -> Health:
        return Health(ok=True, detail=f"deterministic: {self._busy}/{self.settings.slots} busy")

    async def abort(self, request_id: str) -> None:
        return None  # closing the generator stops it

    async def generate(
        self, request: InferRequest, *, prefix: str = "", prefix_tokens: int = 0
    ) -> AsyncGenerator[Chunk, None]:
        script = Script.of(request, faults=self.settings.faults)
        self._busy += 1
        self.started += 1
        settings = self.settings
        paced = settings.prefill_delay_ms > 0 or settings.token_delay_ms > 0
        last = script.last(request.max_tokens)
        try:
            if paced or script.hang_after is not None or script.fail_after is not None:
                async for index in tokens(script, request.max_tokens, prefix_tokens, settings):
                    yield _chunk(script, index, request)
            else:
                # A plain loop, not a second generator: this backend stands in for an engine
                # that costs nothing, so its own cost per token is kept low (1.28 -> 0.44 us,
                # then 0.34 us with the token built here, 64 at a time between pauses).
                tag = script.tag
                scored = request.logprobs
                for begin in range(prefix_tokens, last, 64):
                    for index in range(begin, min(begin + 64, last)):
                        yield _chunk(script, index, request) if scored else Chunk(f" {tag}{index}")
                    await asyncio.sleep(0)  # let the rest of the process run
            produced = max(0, last - prefix_tokens)
            yield Chunk(
                finish_reason="length" if last >= request.max_tokens else "stop",
                usage=Usage(prompt_tokens=prompt_tokens(request), completion_tokens=produced),
            )
        finally:
            self._busy -= 1

    async def generate_scored(
        self, request: InferRequest, *, scored_tokens: int
    ) -> AsyncGenerator[Chunk, None]:
        reading = UNSURE if "[unsure]" in request.text() else SURE
        scored = 0
        async with contextlib.aclosing(self.generate(request)) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is None and scored < scored_tokens:
                    scored += 1
                    yield replace(chunk, confidence=(reading,))
                else:
                    yield chunk


async def tokens(
    script: Script, max_tokens: int, start: int, settings: ModelSettings
) -> AsyncGenerator[int, None]:
    """Token indices from ``start``, paced and with the script's faults."""
    if settings.prefill_delay_ms > 0:
        await asyncio.sleep(settings.prefill_delay_ms / 1000)
    for index in range(start, script.last(max_tokens)):
        if script.hang_after is not None and index >= script.hang_after:
            await asyncio.Event().wait()  # hangs until cancelled
        if script.fail_after is not None and index >= script.fail_after:
            raise BackendError(f"scripted engine failure after {index} tokens", retryable=True)
        if settings.token_delay_ms > 0 and index > start:
            step = settings.token_delay_ms / 1000
            if settings.token_lockstep:  # to the engine's next step, the same for every answer
                step -= asyncio.get_running_loop().time() % step
            await asyncio.sleep(step)
        elif index % 64 == 63:
            await asyncio.sleep(0)  # as fast as possible, but let the rest of the process run
        yield index
