"""Driving one generation: backend chunks, coalesced, numbered into token events.

Shared by the worker and the edge's local path. ``coalesce`` batches backend tokens so that
per-message costs do not cap throughput (the first token always goes out at once);
``generate_into`` runs a request on a backend, optionally continuing an answer another attempt
began, and hands each numbered token event to ``emit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mesh.backends.base import Backend, Chunk
from mesh.config import WorkerSettings
from protocol.errors import BackendError
from protocol.messages import InferRequest, Timings, TokenEvent, Usage
from protocol.stream import AnswerWriter

Emit = Callable[[TokenEvent], Awaitable[None]]


async def coalesce(
    chunks: AsyncIterator[Chunk], *, max_parts: int, linger: float, stall: float | None = None
) -> AsyncGenerator[Chunk, None]:
    """Re-chunk a backend stream: the first token goes out at once; later ones are batched,
    waiting at most ``linger`` seconds for up to ``max_parts`` tokens per chunk. The final chunk
    (with ``finish_reason``) is passed through as it is. Closing this generator closes ``chunks``.

    ``stall``: seconds the backend may go without a chunk before a retryable
    :class:`BackendError` (a hung engine).
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()
    loop = asyncio.get_running_loop()
    progress = [loop.time()]

    async def pump() -> None:
        try:
            async for chunk in chunks:
                progress[0] = loop.time()
                queue.put_nowait(chunk)
        except Exception as exc:  # handed to the consumer, which raises it in order
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    async def watchdog(limit: float) -> None:
        """One timer per generation, not one per token: a hung engine becomes an error."""
        while True:
            await asyncio.sleep(limit / 4)
            if loop.time() - progress[0] > limit:
                queue.put_nowait(
                    BackendError(f"the engine produced nothing for {limit:g}s", retryable=True)
                )
                return

    task = loop.create_task(pump(), name="coalesce-pump")
    guard = loop.create_task(watchdog(stall), name="coalesce-stall") if stall else None
    first = True
    pending: Any = None
    try:
        while True:
            if pending is not None:
                item, pending = pending, None
            else:
                item = await queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None or first:
                first = first and item.finish_reason is not None
                yield item
                continue
            if linger > 0 and queue.qsize() < max_parts - 1:
                await asyncio.sleep(linger)
            parts = [item.text]
            n = item.n
            logprobs = list(item.logprobs) if item.logprobs is not None else None
            while len(parts) < max_parts and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is done or isinstance(nxt, BaseException) or nxt.finish_reason is not None:
                    pending = nxt
                    break
                parts.append(nxt.text)
                n += nxt.n
                if logprobs is not None and nxt.logprobs is not None:
                    logprobs.extend(nxt.logprobs)
            yield Chunk(text="".join(parts), n=n, logprobs=logprobs)
    finally:
        for helper in (task, guard):
            if helper is not None:
                helper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await helper
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class Generation:
    """What streaming one generation produced (``perf_counter`` times)."""

    started: float
    first: float | None
    done: float
    finish_reason: str
    usage: Usage

    def timings(self, since: float, queue_ms: float) -> Timings:
        """Timings as seen from ``since`` (when the request arrived where it is measured)."""
        gen_s = self.done - self.first if self.first is not None else 0.0
        tokens = self.usage.completion_tokens
        return Timings(
            queue_ms=round(queue_ms, 2),
            ttft_ms=round((self.first - since) * 1000, 2) if self.first is not None else None,
            gen_ms=round(gen_s * 1000, 2),
            total_ms=round((self.done - since) * 1000, 2),
            tokens_per_s=round(tokens / gen_s, 2) if gen_s > 0 and tokens > 1 else None,
        )


async def generate_into(
    backend: Backend,
    request: InferRequest,
    writer: AnswerWriter,
    emit: Emit,
    settings: WorkerSettings,
) -> Generation:
    """Run ``request`` on ``backend``; each coalesced chunk becomes ``writer``'s next token event
    and goes to ``emit``. When ``writer`` resumes an answer, the backend continues its text and
    the usage counts the kept tokens too. Does not send the end."""
    started = time.perf_counter()
    first: float | None = None
    final: Chunk | None = None
    resume = writer.resume
    left = request.max_tokens - resume.tokens
    if resume.seq > 0 and left <= 0:  # the previous attempt generated everything but the end
        usage = Usage(completion_tokens=resume.tokens)
        return Generation(started, None, time.perf_counter(), "length", usage)
    chunks = coalesce(
        backend.generate(request, prefix=resume.text, prefix_tokens=resume.tokens),
        max_parts=settings.coalesce_tokens,
        linger=settings.coalesce_ms / 1000,
        stall=settings.stall_timeout,
    )
    new_tokens = 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                final = chunk
                break
            first = first or time.perf_counter()
            new_tokens += chunk.n
            await emit(writer.token(chunk.text, chunk.n, chunk.logprobs))
    usage = final.usage if final and final.usage else Usage(completion_tokens=new_tokens)
    if resume.tokens:  # the engine counted the kept text as prompt; the client asked for it
        usage = Usage(
            prompt_tokens=max(0, usage.prompt_tokens - resume.tokens),
            completion_tokens=usage.completion_tokens + resume.tokens,
        )
    return Generation(
        started=started,
        first=first,
        done=time.perf_counter(),
        finish_reason=final.finish_reason if final and final.finish_reason else "stop",
        usage=usage,
    )
