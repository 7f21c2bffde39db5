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
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from mesh.backends.base import Backend, Chunk, engine_pause
from mesh.config import WorkerSettings
from mesh.eager import cancel_started, start_now
from protocol.errors import BackendError
from protocol.messages import InferRequest, Timings, TokenEvent, Usage
from protocol.stream import AnswerWriter

Emit = Callable[[TokenEvent], Awaitable[None] | None]
"""Takes each token event: a coroutine function, or a plain function for a taker that never
waits (a worker's publisher: no coroutine per token)."""


async def coalesce(
    chunks: AsyncIterator[Chunk], *, max_parts: int, linger: float, stall: float | None = None
) -> AsyncGenerator[Chunk, None]:
    """Re-chunk a backend stream: the first token goes out at once; later ones are batched, up
    to ``max_parts`` tokens per chunk and at most one chunk per ``linger`` seconds. A token that
    arrives more than ``linger`` after the last chunk went out goes at once: a stream slower than
    that (50 tokens/s against 5 ms) is never delayed. The final chunk (with ``finish_reason``) is
    passed through as it is. Closing this generator closes ``chunks``.

    ``stall``: seconds the backend may go without a chunk before a retryable
    :class:`BackendError` (a hung engine).

    While the engine is slower than the linger, its chunks are read in the caller's own task
    and each goes as it comes: no hand-off between tasks per token. The engine sees the request
    one task switch sooner too (0.21 -> 0.12 ms from the start event to the engine call, one
    stream), and a burst reaches it in arrival order. From the first chunk that comes within
    the linger on (a fast engine), a pump task reads the rest, so that tokens gather while the
    caller sends the previous batch (:func:`_batched`).
    """
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    reading = False  # the caller's task awaits the engine (the watchdog may interrupt it)
    stalled = False
    watch = _Watch()
    sent = loop.time()

    def interrupt() -> bool:
        """A hung engine: interrupt the caller's task where it waits on it."""
        nonlocal stalled
        if not reading or me is None:
            return False
        stalled = True
        me.cancel()
        return True

    watch.on_stall = interrupt
    stop_watching = _Watchdog(loop, watch, stall).stop if stall else None
    following = chunks.__anext__
    try:
        while True:  # the engine's chunks, read here in the caller's task (no call per chunk)
            reading = True
            try:
                chunk = await following()
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not stalled:
                    raise
                if me is not None and hasattr(me, "uncancel"):  # Python 3.11+
                    me.uncancel()
                raise _stalled(stall) from None
            finally:
                reading = False
            if stalled:  # the engine swallowed the interruption: it is hung all the same
                raise _stalled(stall)
            watch.produced += 1
            if chunk.finish_reason is not None:
                yield chunk
                return
            now = loop.time()
            if watch.produced > 1 and now - sent < linger:
                break  # a fast engine: batch from here on
            sent = now
            yield chunk
        batched = _batched(chunks, chunk, sent, max_parts, linger, stall, watch)
        async with contextlib.aclosing(batched):
            async for batch in batched:
                yield batch
    finally:
        if stop_watching is not None:
            stop_watching()
        await _close(chunks)


class _Watch:
    """What the stall watchdog reads, and what it does: ``produced`` counts the engine's chunks;
    ``on_stall`` acts on a hung engine and says whether it did (False: not now, keep watching)."""

    def __init__(self) -> None:
        self.produced = 0
        self.on_stall: Callable[[], bool] = lambda: False


class _Watchdog:
    """One timer per generation, not one per token, and no task: calls ``watch.on_stall`` once
    ``watch.produced`` has stood still for ``limit`` seconds (checked every quarter of it). A
    class, not a closure that schedules itself: such a closure refers to itself, and every
    generation's would be left to the garbage collector."""

    __slots__ = ("handle", "limit", "loop", "watch")

    def __init__(self, loop: asyncio.AbstractEventLoop, watch: _Watch, limit: float) -> None:
        self.loop = loop
        self.watch = watch
        self.limit = limit
        self.handle = loop.call_later(limit / 4, self.check, watch.produced, loop.time())

    def check(self, seen: int, since: float) -> None:
        watch, loop = self.watch, self.loop
        if watch.produced != seen:
            seen, since = watch.produced, loop.time()
        elif loop.time() - since > self.limit and watch.on_stall():
            return
        self.handle = loop.call_later(self.limit / 4, self.check, seen, since)

    def stop(self) -> None:
        self.handle.cancel()  # a cancelled handle lets go of its callback (and this watchdog)


async def _batched(  # noqa: PLR0917
    chunks: AsyncIterator[Chunk],
    held: Chunk,
    sent: float,
    max_parts: int,
    linger: float,
    stall: float | None,
    watch: _Watch,
) -> AsyncGenerator[Chunk, None]:
    """The rest of a fast engine's stream, ``held`` first (it came within the linger of the
    chunk that went out at ``sent``): a pump task reads the engine and builds the batches; this
    generator, in the caller's task, takes sealed ones, or the partial one once the linger has
    run out; a hung engine (``watch``) becomes an error in order. Does not close ``chunks``."""
    loop = asyncio.get_running_loop()
    task: asyncio.Task[None] | None = None
    # The pump builds the batches as the engine's tokens come: per token, an append and a
    # count (relay, 4 x 4,000 tokens: the worker's CPU per 10k tokens 15.1 -> 13.5-14.1 ms).
    ready: deque[Any] = deque()  # sealed batches, then the finish, an error or ``done``
    parts: list[str] = [held.text]
    in_parts = held.n  # engine tokens in ``parts``
    lps: list[Any] = list(held.logprobs or [])  # logprobs of ``parts``, when the engine gives them
    with_lps = held.logprobs is not None
    waiting: list[asyncio.Future[None]] = []
    any_token = False  # the waiter wakes on the first token, not only on a full batch
    done = object()
    ended = False  # the last item is queued

    def wake() -> None:
        if waiting and not waiting[0].done():
            waiting[0].set_result(None)

    def seal() -> None:
        nonlocal in_parts, with_lps
        if parts:
            text = parts[0] if len(parts) == 1 else "".join(parts)
            ready.append(Chunk(text=text, n=in_parts, logprobs=lps[:] if with_lps else None))
            parts.clear()
            lps.clear()
            in_parts = 0
            with_lps = False

    def finish(item: Any) -> None:
        nonlocal ended
        seal()
        ready.append(item)
        ended = True
        wake()

    def release(fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_result(None)

    async def until(timeout: float | None, *, on_token: bool) -> None:
        """Wait for a sealed batch or the end, for the first token too when ``on_token``,
        or ``timeout``. A batch that fills up goes at once, not when the linger runs out:
        a fast engine is never held back by the linger (one stream: 1.8 -> 1.1 us a token)."""
        nonlocal any_token
        any_token = on_token
        waiting.append(loop.create_future())
        timer = loop.call_later(timeout, release, waiting[0]) if timeout else None
        try:
            await waiting[0]
        finally:
            waiting.clear()
            if timer is not None:
                timer.cancel()

    async def pump() -> None:
        # Plain closure variables, not one-element lists: this loop runs once per engine
        # token (in process, 4,000 tokens: 0.19 -> 0.16 us a token over the engine's own).
        nonlocal in_parts, with_lps
        append = parts.append
        try:
            async for chunk in chunks:
                watch.produced += 1
                if chunk.finish_reason is not None:
                    finish(chunk)
                    continue
                append(chunk.text)
                in_parts += chunk.n
                if chunk.logprobs is not None:
                    with_lps = True
                    lps.extend(chunk.logprobs)
                if len(parts) >= max_parts:
                    seal()
                    wake()
                elif any_token:
                    wake()
        except Exception as exc:  # handed to the consumer, which raises it in order
            finish(exc)
        finally:
            finish(done)

    def stalled() -> bool:
        finish(_stalled(stall))
        return True

    watch.on_stall = stalled
    try:
        task = loop.create_task(pump(), name="coalesce-pump")
        while True:
            if ready:
                item = ready.popleft()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is None:
                    sent = loop.time()
                yield item
                continue
            if not parts:
                await until(None, on_token=True)
                continue
            wait = sent + linger - loop.time()
            if wait > 0 and not ended:
                # Nothing more can come once the end is queued: the last batch goes at once.
                await until(wait, on_token=False)
                if ready:
                    continue
            seal()
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _close(chunks: AsyncIterator[Chunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


def _stalled(seconds: float | None) -> BackendError:
    return BackendError(f"the engine produced nothing for {seconds:g}s", retryable=True)


class Asked:
    """A generation whose first chunk was asked of the engine already, up to its first wait
    (an HTTP engine's request is on the wire): a worker asks before it prepares the rest of the
    answer (its fingerprint, start event, progress reports), which then runs while the engine
    prefills. Read it as the ``chunks`` of :func:`generate_into`; closing it (which that does)
    stops the engine's generation, however far it got."""

    def __init__(self, chunks: AsyncGenerator[Chunk, None]) -> None:
        self.started = time.perf_counter()
        self._chunks = chunks
        # The rest of the first step, run by whoever reads the first chunk (no task of its own).
        self._first: Coroutine[Any, Any, Chunk] | None = start_now(chunks.__anext__())

    def __aiter__(self) -> Asked:
        return self

    def __anext__(self) -> Awaitable[Chunk]:
        first = self._first
        if first is not None:
            self._first = None
            return first
        return self._chunks.__anext__()

    async def aclose(self) -> None:
        """Stop the generation (idempotent), however far it got."""
        first, self._first = self._first, None
        if first is not None:  # never read: the first step is cancelled where it waits
            await cancel_started(first)
        await self._chunks.aclose()


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
    *,
    chunks: AsyncIterator[Chunk] | None = None,
    asked: Asked | None = None,
) -> Generation:
    """Run ``request`` on ``backend``; each coalesced chunk becomes ``writer``'s next token event
    and goes to ``emit``. When ``writer`` resumes an answer, the backend continues its text and
    the usage counts the kept tokens too. Does not send the end. ``chunks``: a generation
    already under way on ``backend`` (e.g. the edge's held first tokens, then the rest), read
    instead of starting one. ``asked``: this request's generation, asked of ``backend`` already
    (:class:`Asked`; for an answer that starts from nothing only); its timings count from then."""
    resume = writer.resume
    if asked is not None and (resume.seq > 0 or resume.tokens):
        await asked.aclose()  # asked from nothing, and this answer continues another attempt's
        asked = None
    started = time.perf_counter() if asked is None else asked.started
    chunks = asked or chunks
    first: float | None = None
    final: Chunk | None = None
    left = request.max_tokens - resume.tokens
    if resume.seq > 0 and left <= 0:  # the previous attempt generated everything but the end
        usage = Usage(completion_tokens=resume.tokens)
        return Generation(started, None, time.perf_counter(), "length", usage)
    if chunks is None:
        chunks = backend.generate(request, prefix=resume.text, prefix_tokens=resume.tokens)
    coalesced = coalesce(
        chunks,
        max_parts=settings.coalesce_tokens,
        linger=settings.coalesce_ms / 1000,
        stall=settings.stall_timeout,
    )
    new_tokens = 0
    async with contextlib.aclosing(coalesced):
        async for chunk in coalesced:
            if chunk.finish_reason is not None:
                final = chunk
                break
            first = first or time.perf_counter()
            new_tokens += chunk.n
            sent = emit(writer.token(chunk.text, chunk.n, chunk.logprobs))
            if sent is not None:
                await sent
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


ENGINE_FULL_WAITS = 10
"""How often an engine that says it is full is asked again for one patient generation."""


async def generate_patiently(  # noqa: PLR0917 - generate_into's, and whether to wait
    backend: Backend,
    request: InferRequest,
    writer: AnswerWriter,
    emit: Emit,
    settings: WorkerSettings,
    asked: Asked | None,
    *,
    patient: bool,
) -> Generation:
    """:func:`generate_into`; ``patient`` (a worker's last delivery of the request, which no
    other worker would be given): an engine that says it is full (a 429 or 503 with
    ``Retry-After``) before the first token is asked again after that pause, within the
    request's deadline, up to ``ENGINE_FULL_WAITS`` times. Before, that delivery failed too,
    and a request whose engine was busy for three moments ended ``max_deliveries``."""
    begun = writer.seq
    for waits in range(ENGINE_FULL_WAITS + 1):
        try:
            return await generate_into(backend, request, writer, emit, settings, asked=asked)
        except BackendError as err:
            pause = engine_pause(err.retry_after)
            left = None if request.deadline is None else request.deadline - time.time()
            if not patient or pause is None or writer.seq != begun or waits == ENGINE_FULL_WAITS:
                raise
            if left is not None and left <= pause:
                raise
            asked = None  # used: the next generation is asked anew
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")
