"""Sending and receiving one request's event stream (token, restart, end, error).

``EventSink`` is the sending side, shared by the worker (to a token subject) and the edge (to its
client's inbox). ``read_events`` is the receiving side, shared by the edge and the SDK.
``coalesce`` batches backend tokens so per-message costs do not cap throughput.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors
from nats.aio.subscription import Subscription

from mesh.backends.base import Backend, Chunk
from mesh.config import WorkerSettings
from mesh.logs import get_logger
from protocol.codec import CONTENT_TYPE, WireFormat, decode_event, dump, dump_token, error_event
from protocol.codec import to_exception as error_from_event
from protocol.errors import MeshError, MeshTimeoutError, UnavailableError, status_of
from protocol.messages import (
    Answer,
    EndEvent,
    ErrorEvent,
    InferRequest,
    RestartEvent,
    Timings,
    TokenEvent,
    Usage,
)

log = get_logger(__name__)

Publish = Callable[[bytes, dict[str, str]], Awaitable[None]]
NO_RESPONDERS = "503"
SERVICE_ERROR = "Nats-Service-Error"
SERVICE_ERROR_CODE = "Nats-Service-Error-Code"


class Sink(Protocol):
    """Where one request's events go: a NATS subject or inbox, or an HTTP response."""

    collect: bool
    tokens_sent: int
    last_end: EndEvent | None
    last_error: MeshError | None

    async def token(self, text: str, attempt: int = 1) -> None: ...

    async def restart(self, attempt: int, reason: str = "redelivered") -> None: ...

    async def end(self, end: EndEvent) -> None: ...

    async def error(self, error: MeshError) -> None: ...


class EventSink:
    """Numbers, encodes and sends one request's events.

    With ``collect=True`` (a non-streaming client) tokens are gathered and the end goes out as a
    single :class:`Answer`; a restart drops what was gathered so far.
    """

    def __init__(
        self, publish: Publish, request_id: str, fmt: WireFormat, *, collect: bool
    ) -> None:
        self._publish = publish
        self.request_id = request_id
        self.fmt = fmt
        self.collect = collect
        self._headers = {CONTENT_TYPE: fmt.content_type}
        self._seq = 0
        self._parts: list[str] = []
        self.tokens_sent = 0
        self.finished = False
        self.last_end: EndEvent | None = None
        self.last_error: MeshError | None = None

    async def token(self, text: str, attempt: int = 1) -> None:
        self.tokens_sent += 1
        if self.collect:
            self._parts.append(text)
            return
        await self._publish(
            dump_token(self.request_id, self._seq, text, attempt, self.fmt), self._headers
        )
        self._seq += 1

    async def restart(self, attempt: int, reason: str = "redelivered") -> None:
        self._parts.clear()
        if not self.collect:
            event = RestartEvent(id=self.request_id, attempt=attempt, reason=reason)
            await self._publish(dump(event, self.fmt), self._headers)

    async def end(self, end: EndEvent) -> None:
        self.finished = True
        self.last_end = end
        if self.collect:
            fields = end.model_dump(exclude={"t", "seq", "attempt"})
            answer = Answer(**fields, text="".join(self._parts))
            await self._publish(dump(answer, self.fmt), self._headers)
            return
        await self._publish(
            dump(end.model_copy(update={"seq": self._seq}), self.fmt), self._headers
        )

    async def error(self, error: MeshError) -> None:
        """The error event, with the NATS micro error headers that `nats req` shows."""
        self.finished = True
        self.last_error = error
        headers = {
            **self._headers,
            SERVICE_ERROR: f"{error.code.value}: {error.message}"[:512]
            .replace("\r", " ")
            .replace("\n", " "),
            SERVICE_ERROR_CODE: str(status_of(error.code)),
        }
        await self._publish(dump(error_event(error, self.request_id), self.fmt), headers)

    @property
    def seq(self) -> int:
        return self._seq


async def read_events(
    sub: Subscription, *, first_timeout: float, idle_timeout: float, what: str
) -> AsyncGenerator[TokenEvent | RestartEvent | EndEvent, None]:
    """Events from ``sub`` until the end; an error event is raised as its typed ``MeshError``.

    Raises :class:`MeshTimeoutError` when nothing arrives within ``first_timeout`` (first event)
    or ``idle_timeout`` (later ones), :class:`UnavailableError` on a no-responders status.
    """
    timeout = first_timeout
    while True:
        try:
            msg = await sub.next_msg(timeout=timeout)
        except nats.errors.TimeoutError:
            raise MeshTimeoutError(f"no event from {what} within {timeout:g}s") from None
        except nats.errors.ConnectionClosedError:
            raise UnavailableError(f"NATS connection closed while waiting for {what}") from None
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise UnavailableError(f"nobody is serving {what}")
        if not msg.data:
            continue
        try:
            event = decode_event(msg.data, msg.headers)
        except MeshError as exc:
            log.warning("dropping malformed event", source=what, error=str(exc))
            continue
        timeout = idle_timeout
        if isinstance(event, ErrorEvent):
            raise error_from_event(event)
        yield event
        if isinstance(event, (EndEvent, Answer)):
            return


async def coalesce(
    chunks: AsyncIterator[Chunk], *, max_parts: int, linger: float
) -> AsyncGenerator[Chunk, None]:
    """Re-chunk a backend stream: the first token goes out at once; later ones are batched,
    waiting at most ``linger`` seconds for up to ``max_parts`` tokens per chunk. The final chunk
    (with ``finish_reason``) is passed through as it is. Closing this generator closes ``chunks``.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump() -> None:
        try:
            async for chunk in chunks:
                queue.put_nowait(chunk)
        except Exception as exc:  # handed to the consumer, which raises it in order
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    task = asyncio.get_running_loop().create_task(pump(), name="coalesce-pump")
    first = True
    pending: Any = None
    try:
        while True:
            item = pending if pending is not None else await queue.get()
            pending = None
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
            while len(parts) < max_parts and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is done or isinstance(nxt, BaseException) or nxt.finish_reason is not None:
                    pending = nxt
                    break
                parts.append(nxt.text)
            yield Chunk(text="".join(parts))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


@dataclass
class Generation:
    """What streaming one generation into a sink produced (``perf_counter`` times)."""

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
    backend: Backend, request: InferRequest, sink: Sink, settings: WorkerSettings, attempt: int = 1
) -> Generation:
    """Run ``request`` on ``backend``, sending coalesced tokens to ``sink`` (not the end)."""
    started = time.perf_counter()
    first: float | None = None
    final: Chunk | None = None
    chunks = coalesce(
        backend.generate(request),
        max_parts=settings.coalesce_tokens,
        linger=settings.coalesce_ms / 1000,
    )
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if chunk.finish_reason is not None:
                final = chunk
                break
            first = first or time.perf_counter()
            await sink.token(chunk.text, attempt)
    return Generation(
        started=started,
        first=first,
        done=time.perf_counter(),
        finish_reason=final.finish_reason if final and final.finish_reason else "stop",
        usage=final.usage if final and final.usage else Usage(completion_tokens=sink.tokens_sent),
    )
