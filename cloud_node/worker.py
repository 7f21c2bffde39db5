"""The cloud worker: pulls escalated requests only as fast as it has free slots, streams tokens to
each request's token subject, and acks a request only once its end message is flushed.

Back-pressure is the pull itself: a worker never holds more unacked requests than it has slots,
and ``max_ack_pending`` on the consumer caps the whole fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from cloud_node.cancels import RecentIds
from mesh import __version__
from mesh.backends.base import Backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.events import EventSink, generate_into
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger, log_unknown_fields
from mesh.provision import provision
from mesh.queue import trace_headers
from mesh.registry import Heartbeat, NodeInfo
from mesh.tasks import TaskSet
from protocol.codec import decode_request, reply_target, sniff
from protocol.errors import (
    CancelledByClientError,
    DeadlineExceededError,
    ErrorCode,
    MaxDeliveriesError,
    MeshError,
    UnknownModelError,
)
from protocol.messages import EndEvent, InferRequest
from protocol.subjects import (
    CANCEL_WILDCARD,
    consumer_name,
    model_token,
    request_id_of,
    token_subject,
)

log = get_logger(__name__)
CAPACITY_POLL_S = 0.25


@dataclass
class WorkerStats:
    fetched: int = 0
    completed: int = 0
    rejected: int = 0
    failed: int = 0
    cancelled: int = 0
    requeued: int = 0


class Worker(Lifecycle):
    """One worker process (or model replica) serving ``backend.model``."""

    def __init__(self, settings: MeshSettings, conn: Connection, backend: Backend) -> None:
        self.settings = settings
        self.conn = conn
        self.backend = backend
        self.node_id = settings.worker.node_id
        self.stats = WorkerStats()
        self._ws = settings.worker
        self._stream = settings.stream
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._reserved = 0
        self._cancelled = RecentIds(ttl=self._stream.ack_wait * self._stream.max_deliver + 60)
        self._tasks = TaskSet("worker")
        self._wake = asyncio.Event()
        self._stopping = False
        self._psub: JetStreamContext.PullSubscription | None = None
        self._cancel_sub: Subscription | None = None
        self._loop_task: asyncio.Task[Any] | None = None
        self._heartbeat = Heartbeat(
            conn, self.node_info, self._stream.heartbeat, self._stream.node_ttl
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await provision(self.conn.jsm(), self._stream, [self.backend.model])
        self._psub = await self.conn.js.pull_subscribe_bind(
            durable=consumer_name(self.backend.model), stream=self._stream.name
        )
        self._cancel_sub = await self.conn.nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel)
        await self.conn.nc.flush(timeout=max(1, round(self.conn.settings.request_timeout)))
        await self._heartbeat.start()
        self._loop_task = asyncio.get_running_loop().create_task(self._pull_loop(), name="pull")
        log.info(
            "worker started",
            node_id=self.node_id,
            model=self.backend.model,
            slots=self.backend.capacity().total,
            consumer=consumer_name(self.backend.model),
        )

    async def stop(self) -> None:
        """Ordered: stop pulling, let in-flight requests finish (grace), requeue the rest."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        await self._heartbeat.stop()  # edges stop counting on us before intake stops
        if self._loop_task is not None:
            # The loop checks the flag between fetches; a fetch lasts at most fetch_timeout.
            try:
                await asyncio.wait_for(self._loop_task, self._ws.fetch_timeout + 2)
            except asyncio.TimeoutError:
                self._loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._loop_task
        if self._inflight:
            log.info(
                "draining in-flight requests",
                count=len(self._inflight),
                grace_s=self._ws.drain_grace,
            )
        await self._tasks.close(grace=self._ws.drain_grace)
        for sub in (self._cancel_sub, self._psub):
            if sub is not None:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        log.info("worker stopped", node_id=self.node_id, **vars(self.stats))

    def node_info(self) -> NodeInfo:
        capacity = self.backend.capacity()
        return NodeInfo(
            node_id=self.node_id,
            role="worker",
            models=[self.backend.model],
            slots=capacity.total,
            free=self.free_slots(),
            version=__version__,
        )

    # -- intake ----------------------------------------------------------------------------
    def free_slots(self) -> int:
        capacity = self.backend.capacity()
        return max(0, min(capacity.total - self._reserved, capacity.free))

    async def _pull_loop(self) -> None:
        assert self._psub is not None
        while not self._stopping:
            free = self.free_slots()
            if free <= 0:
                # Our own completions set _wake; engine-side capacity (another user of the engine,
                # KV-cache pressure) changes silently, so look again shortly either way.
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), CAPACITY_POLL_S)
                continue
            try:
                msgs = await self._psub.fetch(
                    batch=min(free, self._ws.fetch_batch), timeout=self._ws.fetch_timeout
                )
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error as exc:  # disconnected, reconnecting...: retry shortly
                log.warning("fetch failed", error=repr(exc))
                await asyncio.sleep(min(1.0, self._ws.fetch_timeout))
                continue
            for msg in msgs:
                if self._stopping:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.nak()  # hand it to another worker now, not after ack_wait
                    continue
                self.stats.fetched += 1
                self._reserved += 1
                self._tasks.spawn(self._handle(msg), name="request")

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = request_id_of(msg.subject)
        self._cancelled.add(request_id)
        task = self._inflight.get(request_id)
        if task is not None:
            log.info("cancelling request", request_id=request_id)
            task.cancel()

    # -- one request -----------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        try:
            await self._handle_inner(msg)
        finally:
            self._reserved -= 1
            self._wake.set()

    async def _handle_inner(self, msg: Msg) -> None:
        attempt = msg.metadata.num_delivered
        try:
            request, fmt = decode_request(
                msg.data,
                msg.headers,
                limits=self.settings.limits.request_limits(),
                strict=self.settings.strict_decode,
                on_unknown=log_unknown_fields,
            )
            self._check(request)
        except MeshError as err:
            await self._reject(msg, err)
            return
        task = asyncio.current_task()
        assert task is not None
        self._inflight[request.id] = task
        sink = EventSink(
            self._publisher(request.reply or token_subject(request.id)),
            request.id,
            fmt.reply_format,
            collect=False,
        )
        with structlog.contextvars.bound_contextvars(
            request_id=request.id,
            node_id=self.node_id,
            subject=msg.subject,
            attempt=attempt,
            **trace_headers(msg.headers),
        ):
            try:
                await self._generate(msg, request, sink, attempt)
            finally:
                self._inflight.pop(request.id, None)

    def _check(self, request: InferRequest) -> None:
        if request.model is not None and model_token(request.model) != model_token(
            self.backend.model
        ):
            raise UnknownModelError(
                f"this worker serves {self.backend.model!r}, not {request.model!r}",
                request_id=request.id,
            )
        if request.is_expired():
            raise DeadlineExceededError(
                "the request's deadline passed before it could start", request_id=request.id
            )
        if request.id in self._cancelled:
            raise CancelledByClientError("cancelled before it started", request_id=request.id)

    async def _reject(self, msg: Msg, err: MeshError) -> None:
        """Answer a request that will never run, where its sender can hear, and drop it."""
        request_id, reply = reply_target(msg.data, msg.headers)
        request_id = err.request_id or request_id
        subject = reply or (token_subject(request_id) if request_id else None)
        self.stats.rejected += 1
        log.warning(
            "request rejected",
            code=err.code.value,
            error=err.message,
            request_id=request_id,
            subject=msg.subject,
            answered=subject is not None,
        )
        if subject is not None:
            fmt = sniff(msg.data, msg.headers).reply_format
            sink = EventSink(self._publisher(subject), request_id or "", fmt, collect=False)
            with contextlib.suppress(MeshError):
                await sink.error(err)
        with contextlib.suppress(nats.errors.Error):
            if err.code is ErrorCode.CANCELLED:
                await msg.ack()
            else:
                await msg.term()

    async def _generate(
        self, msg: Msg, request: InferRequest, sink: EventSink, attempt: int
    ) -> None:
        queued_ms = max(0.0, (time.time() - msg.metadata.timestamp.timestamp()) * 1000)
        keepalive = self._tasks.spawn(self._keep_alive(msg), name="in-progress")
        try:
            if attempt > 1:
                await sink.restart(attempt)
            gen = await generate_into(self.backend, request, sink, self._ws, attempt)
            timings = gen.timings(since=gen.started, queue_ms=queued_ms)
            await sink.end(
                EndEvent(
                    id=request.id,
                    seq=0,
                    attempt=attempt,
                    path="cloud",
                    finish_reason=gen.finish_reason,
                    usage=gen.usage,
                    timings=timings,
                    served_by=f"cloud:{self.node_id}",
                    routing=request.routing,
                )
            )
            await self.conn.nc.flush(timeout=max(1, round(self._ws.publish_timeout)))
            await msg.ack_sync(timeout=self._ws.publish_timeout)
            self.stats.completed += 1
            log.info(
                "request done",
                tokens=gen.usage.completion_tokens,
                queue_ms=timings.queue_ms,
                ttft_ms=timings.ttft_ms,
                total_ms=timings.total_ms,
            )
        except asyncio.CancelledError:
            if request.id in self._cancelled:
                self.stats.cancelled += 1
                log.info("request cancelled by client")
                with contextlib.suppress(MeshError, nats.errors.Error):
                    await sink.error(CancelledByClientError("cancelled", request_id=request.id))
                    await msg.ack()
                return  # the cancel was ours to act on; the task ends normally
            # Shutdown: give it back so another worker restarts it promptly.
            self.stats.requeued += 1
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
            raise
        except MeshError as err:
            await self._failed(msg, sink, err, attempt)
        except Exception as exc:  # a bug: answer typed, keep the worker alive
            log.exception("request crashed")
            await self._failed(
                msg,
                sink,
                MeshError(f"worker failure: {type(exc).__name__}", retryable=True),
                attempt,
            )
        finally:
            keepalive.cancel()

    async def _failed(self, msg: Msg, sink: EventSink, err: MeshError, attempt: int) -> None:
        self.stats.failed += 1
        if err.retryable and attempt < self._stream.max_deliver:
            log.warning("generation failed; requeued", code=err.code.value, error=err.message)
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=1.0)
            return
        if err.retryable:
            err = MaxDeliveriesError(
                f"failed on {attempt} deliveries; last error: {err.message}",
                request_id=sink.request_id,
                retryable=False,
            )
        log.warning("generation failed", code=err.code.value, error=err.message)
        with contextlib.suppress(MeshError, nats.errors.Error):
            await sink.error(err)
        with contextlib.suppress(nats.errors.Error):
            await msg.term()

    async def _keep_alive(self, msg: Msg) -> None:
        interval = self._stream.ack_wait * self._ws.progress_fraction
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except nats.errors.Error as exc:
                log.warning("in_progress failed", error=repr(exc))

    def _publisher(self, subject: str) -> Any:
        nc = self.conn.nc

        async def publish(data: bytes, headers: dict[str, str]) -> None:
            try:
                await nc.publish(subject, data, headers=headers)
            except nats.errors.Error as exc:
                raise MeshError(
                    f"cannot publish events: {type(exc).__name__}", code=ErrorCode.UNAVAILABLE
                ) from None

        return publish
