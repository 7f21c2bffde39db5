"""Serving one delivered request, from its queue message to its ack.

Decode and admit it (a request that can never run is rejected with a typed error), claim it
when it can wait (one queued copy answers), take over what an earlier attempt left in the
answer store, generate, publish its events, store the outcome, keep it for its site when it
can wait, and only then ack. A cancel, a shutdown, a lost lease or a failure each end it in
exactly one way (:mod:`cloud_node.outcomes`). The worker (:mod:`cloud_node.worker`) owns the
intake and the process's lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg

from cloud_node.admission import check
from cloud_node.cancels import CancelBook
from cloud_node.keeper import Keeper
from cloud_node.lease import OTHER_COPY, Lease, Leases
from cloud_node.outcomes import Outcomes, ack
from cloud_node.progress import KeepAlive, LoopStalls
from cloud_node.publisher import AnswerPublisher, Settler
from cloud_node.takeover import Takeover, Unread, unseen_attempt
from mesh.answer_store import AnswerStore
from mesh.backends.base import Backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.generate import generate_into
from mesh.logs import get_logger, log_unknown_fields, trace_id
from mesh.metrics import WorkerMetrics
from mesh.queue import trace_headers
from mesh.tasks import TaskSet
from mesh.tracing import Tracing
from protocol.codec import decode_request, error_event
from protocol.errors import (
    CancelledByClientError,
    DeadlineExceededError,
    InvalidRequestError,
    MeshError,
)
from protocol.messages import InferRequest, StartEvent
from protocol.stream import AnswerWriter, request_fingerprint
from protocol.subjects import scope_of, token_subject

log = get_logger(__name__)


class Handler:
    """Serves the requests a worker's puller delivers, one task each (:meth:`handle`)."""

    def __init__(
        self,
        settings: MeshSettings,
        conn: Connection,
        backend: Backend,
        *,
        store: AnswerStore,
        keeper: Keeper,
        leases: Leases,
        takeover: Takeover,
        outcomes: Outcomes,
        settler: Settler,
        cancels: CancelBook,
        tasks: TaskSet,
        tracing: Tracing,
        metrics: WorkerMetrics,
        count: Callable[..., None],
        republished: Callable[[AnswerPublisher], None],
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.backend = backend
        self.node_id = settings.worker.node_id
        self.store = store
        self.keeper = keeper
        self.leases = leases
        self.takeover = takeover
        self.outcomes = outcomes
        self.settler = settler
        self.cancels = cancels
        self._tasks = tasks
        """Where progress reports run (the worker's own tasks)."""
        self.tracing = tracing
        self.metrics = metrics
        self.count = count
        """Counts one delivery's outcome (``count("failed", code)``)."""
        self.republished = republished
        """Counts the events a publisher published again."""
        self._ws = settings.worker
        self._stream = settings.stream
        self.inflight: dict[str, tuple[asyncio.Task[Any], InferRequest]] = {}
        """Requests being served, by token subject (cancels find them here)."""
        self.publishers: dict[str, AnswerPublisher] = {}
        """Their publishers (a reconnect has each catch up)."""
        self.ack = ack
        """Acks a served request without waiting (:func:`cloud_node.outcomes.ack`)."""
        self.keepalives: dict[str, KeepAlive] = {}
        """The answers being generated, by token subject: checked again after a stand-still
        or a reconnect (:meth:`recheck`)."""
        self.stalls = LoopStalls(on_stall=self.recheck)
        """This process's stand-stills (the worker runs its ticker)."""

    async def handle(self, msg: Msg) -> None:
        """One delivery, in its own task; returns once the queue message is acked, handed back
        or left to its redelivery, never raising for the request's sake."""
        received = asyncio.get_running_loop().time()
        drops, stalls = self.conn.drops, self.stalls.count()
        attempt = msg.metadata.num_delivered
        if attempt > 1:
            self.metrics.redeliveries.inc()
        request: InferRequest | None = None
        scope: str | None = None
        try:
            request, fmt = decode_request(
                msg.data,
                msg.headers,
                limits=self.settings.limits.request_limits(),
                strict=self.settings.strict_decode,
                on_unknown=log_unknown_fields,
            )
            scope = scope_of(msg.subject)
            if scope is None:
                raise InvalidRequestError(
                    f"queued on {msg.subject!r}: requests go to mesh.v1.infer.<model>.<scope>",
                    request_id=request.id,
                )
            address = token_subject(scope, request.id)
            check(request, address, self.backend.model, self.cancels)
        except MeshError as err:
            if request is not None and request.deferrable and scope is not None:
                kept = await self.outcomes.kept_or_nak(
                    msg, scope, request, error_event(err, request.id)
                )
                if not kept:
                    return
            await self.outcomes.reject(msg, err, attempt)
            return
        task = asyncio.current_task()
        assert task is not None
        self.inflight[address] = (task, request)
        traced = trace_headers(msg.headers)
        traced_id = trace_id(traced.get("traceparent"))
        with structlog.contextvars.bound_contextvars(
            request_id=request.id,
            node_id=self.node_id,
            subject=msg.subject,
            attempt=attempt,
            **traced,
            **({"trace_id": traced_id} if traced_id else {}),
        ):
            try:
                with self.tracing.span(
                    "mesh.worker.request",
                    msg.headers,
                    **{"mesh.request_id": request.id, "mesh.attempt": attempt},
                ):
                    await self._serve(
                        msg, request, scope, fmt.reply_format, attempt, received, (drops, stalls)
                    )
            finally:
                self.inflight.pop(address, None)

    async def _serve(  # noqa: PLR0917
        self,
        msg: Msg,
        request: InferRequest,
        scope: str,
        fmt: Any,
        attempt: int,
        received: float,
        since: tuple[int, int],
    ) -> None:
        queued_ms = max(0.0, (time.time() - msg.metadata.timestamp.timestamp()) * 1000)
        drops, stalls = since  # the connection's drops and the loop's stalls at delivery
        publisher = AnswerPublisher(
            self.conn, self.store, scope, request.id, fmt, timeout=self._ws.publish_timeout
        )
        address = publisher.subject
        fingerprint = request_fingerprint(request)  # once: a hash of the whole conversation
        lease: Lease | None = None
        if request.deferrable:
            claimed = await self._claim(scope, request, msg.metadata.sequence.stream, fingerprint)
            if claimed == OTHER_COPY:  # that copy is still queued, or its answer is kept
                self.count("other_copy")
                log.info("another copy of this request is being answered; acking this one")
                await self.ack(msg)
                return
            lease = claimed if isinstance(claimed, Lease) else None
        found = await self.takeover.history(request, fingerprint, publisher, attempt)
        history = None if found is Unread.STORE else found
        writer = AnswerWriter(
            request.id,
            # Another copy may have begun it unseen: number above it (see unseen_attempt).
            attempt=unseen_attempt() if found is Unread.STORE else attempt,
            node=f"cloud:{self.node_id}",
            fingerprint=fingerprint,
        )
        if history is not None and history.done:
            await self.takeover.already_done(msg, publisher, history, request, scope)
            return
        if request.deferrable and await self.keeper.exists(scope, request.id):
            # Forwarded again after its answer was kept (a flap outlived the dedupe window).
            self.count("already_done")
            log.info("answer already kept; acking without generating")
            await self.ack(msg)
            return
        started_before = history is not None and history.started
        if not started_before and request.start_by is not None and time.time() >= request.start_by:
            late = DeadlineExceededError(
                "no worker could start the request before its start_by time",
                request_id=request.id,
            )
            if request.deferrable and not await self.outcomes.kept_or_nak(
                msg, scope, request, error_event(late, request.id)
            ):
                return
            await self.outcomes.reject(msg, late, attempt)
            return
        if history is not None and history.started:
            # Another copy's attempts may be in the store too (a request that can wait, queued
            # twice): this attempt numbers after all of them. ``attempt`` stays the delivery
            # count, which decides retries.
            writer = self.takeover.writer(request, history, max(attempt, history.attempt + 1))
        writer.delivery = msg.reply  # a survivor hands it back at once if this worker dies
        generating = asyncio.current_task()
        assert generating is not None
        ours = writer.attempt
        keepalive = KeepAlive(
            self._tasks,
            self._stream.ack_wait * self._ws.progress_fraction,
            received=received,
            newer_attempt=lambda: self._newer_attempt(address, ours),
            connected=lambda: self.conn.connected,
            interrupted=lambda: self.conn.drops != drops or self.stalls.count() != stalls,
            msg=msg,
            lease=lease,
            ack_wait=self._stream.ack_wait,
            leases=self.leases,
            claim=lambda copy, fingerprint: self._claim(scope, request, copy, fingerprint),
            generating=generating,
        )
        last = attempt >= self._stream.max_deliver
        self.keepalives[address] = keepalive

        async def lapsed() -> bool:
            """The delivery may be another worker's. Never on the last delivery: JetStream gives
            it to nobody else (and no worker hands it back), and a message left unsettled there
            is given up on (the MAX_DELIVERIES advisory), its outcome decided without this
            answer."""
            return not last and await keepalive.taken_over()

        self.publishers[address] = publisher
        try:
            await publisher.send(writer.start())
            gen = await generate_into(self.backend, request, writer, publisher.send, self._ws)
            timings = gen.timings(since=gen.started, queue_ms=queued_ms)
            end = writer.end(
                finish_reason=gen.finish_reason,
                usage=gen.usage,
                timings=timings,
                served_by=f"cloud:{self.node_id}",
                routing=request.routing,
            )
            stored = await publisher.finish(end)
            self.republished(publisher)
            if not stored:  # acked all the same; its events still go to the store when it can
                self.settler.later(publisher)
            if await lapsed():  # the delivery may be another worker's: it settles the message
                log.warning("answer done after a lapse; leaving the request to its holder")
            elif request.deferrable and not await self._keep(msg, scope, request, publisher):
                return
            else:
                await self.ack(msg)
            self.count("completed")
            self.metrics.observe(gen, timings)
            log.info(
                "request done",
                tokens=gen.usage.completion_tokens,
                positions=end.seq,
                resumed_at=writer.resume.seq,
                queue_ms=timings.queue_ms,
                ttft_ms=timings.ttft_ms,
                total_ms=timings.total_ms,
                stored=stored,
            )
        except asyncio.CancelledError:
            if self.cancels.cancels(address, request):
                self.count("cancelled")
                log.info("request cancelled by client")
                cancelled = CancelledByClientError("cancelled", request_id=request.id)
                with contextlib.suppress(MeshError, nats.errors.Error):
                    await publisher.finish(writer.error(cancelled))
                    if request.deferrable:  # asked for again by id, it says so
                        await self.keeper.keep(
                            scope, request, None, error_event(cancelled, request.id)
                        )
                    await msg.ack()  # not acked: the redelivery is refused, kept and answered
                return  # the cancel was ours to act on; the task ends normally
            if keepalive.stopped:  # a newer attempt took it over while this worker stood still
                self.count("superseded")
                return
            # Shutdown or a lost lease: give it back so another worker continues it promptly,
            # after what this attempt generated (the next one resumes from the store).
            self.count("requeued")
            await self.conn.flush_outbox()
            if not await lapsed():  # else not ours to give back: its holder continues it
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()
            raise
        except MeshError as err:
            if await lapsed():  # not ours to fail: its holder (or redelivery) continues it
                log.warning("generation failed after a lapse", code=err.code.value)
                return
            await self.outcomes.failed(msg, publisher, writer, err, attempt, request=request)
        except Exception as exc:  # a bug: answer typed, keep the worker alive
            log.exception("request crashed")
            if await lapsed():
                return
            await self.outcomes.failed(
                msg,
                publisher,
                writer,
                MeshError(f"worker failure: {type(exc).__name__}", retryable=True),
                attempt,
                request=request,
            )
        finally:
            keepalive.stop()
            self.publishers.pop(address, None)
            self.keepalives.pop(address, None)

    def alive(self, address: str) -> dict[str, bool]:
        """What this worker says of the request on ``address`` to a reader who asks whether it
        is there: whether it holds it, and whether its engine stands still on it."""
        if address not in self.inflight:
            return {"held": False}
        return {"held": True, "stalled": self.stalled(address)}

    def stalled(self, address: str) -> bool:
        """Whether the engine stands still on this answer: no token for ``report_stall_after``
        after its first, and none for any other answer it generates either (an engine busy with
        others, or one that preempted this answer, still moves: that is slow, not stalled)."""
        publisher = self.publishers.get(address)
        if publisher is None or publisher.last_token is None:
            return False  # before the first token: the edge's first-token timeout judges
        now, bound = time.monotonic(), self._ws.report_stall_after
        return all(
            p.last_token is None or now - p.last_token >= bound for p in self.publishers.values()
        )

    def recheck(self) -> None:
        """After a stand-still or a reconnect: stop at once every answer another worker took
        over meanwhile (see :mod:`cloud_node.orphans`)."""
        for keepalive in list(self.keepalives.values()):
            keepalive.recheck()

    async def _newer_attempt(self, address: str, attempt: int) -> bool:
        """Whether the answer store holds an attempt newer than ``attempt``: another worker took
        the request over (read only after this worker's progress reports lapsed)."""
        timeout = min(self._ws.publish_timeout, 0.2 * self._stream.ack_wait)
        events = await self.store.replay(address, timeout=timeout)
        return any(isinstance(e, StartEvent) and e.attempt > attempt for e in events)

    async def _keep(
        self, msg: Msg, scope: str, request: InferRequest, publisher: AnswerPublisher
    ) -> bool:
        """Keep a finished answer for its site; False when it cannot be kept now. The message
        is then handed back, not failed (its answer is out already): a later delivery finds it
        done and keeps it without generating again."""
        try:
            await self.keeper.keep(scope, request, publisher)
        except MeshError as err:
            log.warning("answer not kept; handing the request back", error=err.message)
            self.count("requeued")
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=1.0)
            return False
        return True

    async def _claim(
        self, scope: str, request: InferRequest, copy: int, fingerprint: str
    ) -> Lease | str | None:
        """The lease for queued copy ``copy`` of a request that can wait (see
        :meth:`Leases.claim`); a copy whose answer is kept already counts as answered."""
        return await self.leases.claim(
            scope, request.id, copy, fingerprint, lambda: self.keeper.exists(scope, request.id)
        )
