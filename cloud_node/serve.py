"""Serving one delivered request, from its queue message to its ack: the plain path.

:meth:`Handler.handle` decodes a delivery and sends it down one of two paths, once. A request
that cannot wait (an interactive one) takes :meth:`Handler.serve`, here, read top to bottom:
admit it (a request that can never run is rejected with a typed error), take over what an
earlier attempt left in the answer store, generate, publish its events, store the end, and only
then ack. Its sender reads the answer on the token subject; nothing else is kept for it.

A request that can wait takes its own path (:mod:`cloud_node.deferred`): a lease so that one
queued copy answers, its outcome kept for its site before any ack, attempts numbered past what
the store may hold unseen. It is built from the same steps as this one (:meth:`Handler._admit`,
:meth:`Handler._serving`, :meth:`Handler._generate`) and the same parts (:class:`Parts`), so the
plain path carries none of its rules. What differs when an attempt ends is one object,
:class:`cloud_node.delivery.Release`: how the message is let go.

A cancel, a shutdown, a lost delivery or a failure each end an attempt in exactly one way
(:meth:`Handler._generate`, :mod:`cloud_node.outcomes`). The worker (:mod:`cloud_node.worker`)
owns the intake and the process's lifecycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cloud_node.admission import check
from cloud_node.cancels import CancelBook
from cloud_node.counts import WorkerCounts
from cloud_node.delivery import Ack, Delivery, Release, queued_id, queued_once, store_look_timeout
from cloud_node.epoch import QueueEpoch
from cloud_node.outcomes import Outcomes, ack
from cloud_node.progress import KeepAlive, LoopStalls, Renew
from cloud_node.publisher import AnswerPublisher, Settler
from cloud_node.takeover import Takeover, Unread, too_late, unseen_attempt
from mesh.answer_store import AnswerStore
from mesh.backends.base import Backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.generate import Asked, generate_patiently
from mesh.logs import bound, get_logger, log_unknown_fields, trace_id
from mesh.queue import COPY_HEADER
from mesh.tasks import CancelAt, TaskSet, answered_cancel, cancel_and_wait
from mesh.tracing import Tracing, trace_headers
from protocol.codec import WireFormat, decode_request
from protocol.errors import (
    CancelledByClientError,
    DeadlineExceededError,
    InvalidRequestError,
    MeshError,
)
from protocol.fingerprint import request_fingerprint
from protocol.messages import InferRequest, StartEvent
from protocol.stream import AnswerState, AnswerWriter
from protocol.subjects import cloud_node_name, scope_of, token_subject

log = get_logger(__name__)


@dataclass(frozen=True)
class Parts:
    """The worker's parts that serving a request uses, each built once by the worker (several
    serve its other duties too: the store its orphans, the outcomes its advisories)."""

    conn: Connection
    backend: Backend
    store: AnswerStore
    takeover: Takeover
    outcomes: Outcomes
    settler: Settler
    cancels: CancelBook
    tasks: TaskSet  # where progress reports run (the worker's own tasks)
    tracing: Tracing


class Handler(ABC):
    """Serves the requests a worker's puller delivers, one task each (:meth:`handle`). The worker
    builds :class:`cloud_node.deferred.DeferrableHandler`, which adds the path of requests that
    can wait."""

    def __init__(self, settings: MeshSettings, parts: Parts, counts: WorkerCounts) -> None:
        self.settings = settings
        self.conn = parts.conn
        self.backend = parts.backend
        self.store = parts.store
        self.takeover = parts.takeover
        self.outcomes = parts.outcomes
        self.settler = parts.settler
        self.cancels = parts.cancels
        self.tasks = parts.tasks
        self.tracing = parts.tracing
        self.counts = counts
        """Where every event of serving is counted (STATS and Prometheus)."""
        self.node = cloud_node_name(settings.worker.node_id)
        """This worker, as events name it."""
        self._ws = settings.worker
        self._stream = settings.stream
        self.inflight: dict[str, tuple[asyncio.Task[Any], InferRequest]] = {}
        """Requests being served, by token subject (cancels find them here)."""
        self.last_deliveries: set[asyncio.Task[Any]] = set()
        """Those on their queue message's last delivery: a stopping worker finishes them."""
        self.publishers: dict[str, AnswerPublisher] = {}
        """Their publishers (a reconnect has each catch up)."""
        self.ack: Ack = ack
        """Acks a served request without waiting (:func:`cloud_node.outcomes.ack`)."""
        self.keepalives: dict[str, KeepAlive] = {}
        """The answers being generated, by token subject: checked again after a stand-still
        or a reconnect (:meth:`recheck`)."""
        self.stalls = LoopStalls(on_stall=self.recheck)
        """This process's stand-stills (the worker runs its ticker)."""
        self.epoch = QueueEpoch(parts.conn, store_look_timeout(settings))

    async def hand_over(self, claim: Callable[[int], Awaitable[int]]) -> bool:
        """A stopping worker's hand-over: cancel the youngest requests, one per peer slot ``claim``
        reserved (counted after it: one may end meanwhile), for others to continue from the store,
        none on its last delivery (no worker would get it again); True when some drain here."""
        last = self.last_deliveries
        room = await claim(sum(task not in last for task, _request in self.inflight.values()))
        can = [task for task, _request in self.inflight.values() if task not in last]
        over = can[len(can) - min(room, len(can)) :]  # a reserved peer's slot each, no more
        left = len(self.inflight) - len(over)
        log.info("handing in-flight requests over", count=len(over), draining=left)
        await cancel_and_wait(over)
        return left > 0

    async def handle(self, msg: Msg) -> None:
        """One delivery, in its own task; returns once the queue message is acked, handed back
        or left to its redelivery, never raising for the request's sake."""
        attempt = msg.metadata.num_delivered
        loop = asyncio.get_running_loop()
        delivery = Delivery(msg, attempt, loop.time(), self.conn.drops, self.stalls.count())
        request: InferRequest | None = None
        try:
            held = COPY_HEADER in (msg.headers or {}) or await self.epoch.predates(msg)
            delivery.maybe_held = held
            if attempt > 1:
                self.counts.redelivery()
            try:
                request, fmt = decode_request(
                    msg.data,
                    msg.headers,
                    limits=self.settings.limits.request_limits(),
                    strict=self.settings.strict_decode,
                    on_unknown=log_unknown_fields,
                    missing_id=queued_id(msg),
                )
            except MeshError as err:
                await self.refuse_undecoded(msg, err, delivery.number())
                return
            if request.deferrable:  # its own path: cloud_node.deferred
                await self.serve_deferrable(delivery, request, fmt.reply_format)
            else:
                await self.serve(delivery, request, fmt.reply_format)
        except asyncio.CancelledError:
            if delivery.generating or not await self._cut_short(delivery, request):
                raise

    async def _cut_short(self, delivery: Delivery, request: InferRequest | None) -> bool:
        """Settle a delivery cancelled before its generation held it (a store or lease look):
        a client's cancel answers it (True: the task ends normally); a shutdown hands it back at
        once, not after ``ack_wait``."""
        msg = delivery.msg
        scope = scope_of(msg.subject)
        if (
            request is not None
            and scope is not None
            and self.cancels.cancels(token_subject(scope, request.id), request)
        ):
            err = CancelledByClientError("cancelled before it started", request_id=request.id)
            await self.refuse(msg, scope, request, err, delivery.number())
            return True
        self.counts.outcome("requeued")
        with contextlib.suppress(nats.errors.Error):
            await msg.nak()
        return False

    async def refuse(
        self, msg: Msg, scope: str | None, request: InferRequest, err: MeshError, attempt: int
    ) -> None:
        """Answer a request that will never run with its typed error, and drop it."""
        await self.outcomes.reject(msg, err, attempt)

    async def refuse_undecoded(self, msg: Msg, err: MeshError, attempt: int) -> None:
        """A delivery refused as it was decoded here (see :mod:`cloud_node.deferred`)."""
        await self.outcomes.reject(msg, err, attempt)

    @abstractmethod
    async def serve_deferrable(
        self, delivery: Delivery, request: InferRequest, fmt: WireFormat
    ) -> None:
        """A request that can wait (:mod:`cloud_node.deferred`)."""

    async def serve(self, delivery: Delivery, request: InferRequest, fmt: WireFormat) -> None:
        """A request that cannot wait, from its delivery to its ack."""
        msg, attempt = delivery.msg, delivery.attempt
        try:
            scope = self._admit(msg, request)
        except MeshError as err:
            await self.outcomes.reject(msg, err, delivery.number())
            return
        delivery.shares_id = not queued_once(msg, scope, request.id)  # queued by hand
        with self._serving(delivery, request, scope):
            queued_ms = delivery.queued_ms()
            # A first delivery asks the engine now: what follows runs while it prefills (a
            # redelivery first reads what earlier attempts left, to continue from it).
            asked = None
            first = attempt == 1 and not delivery.maybe_held and not delivery.shares_id
            if first and too_late(request, None) is None:
                asked = Asked(self.backend.generate(request))
            try:
                publisher = self._publisher(scope, request, fmt)
                fingerprint = request_fingerprint(request)  # once: a hash of the conversation
                found = await self.takeover.history(
                    request, fingerprint, publisher.subject, look=not first
                )
                history = None if found is Unread.STORE else found
                if history is not None and history.done and delivery.answers_anew(request, history):
                    found = None  # another message's answer: this one is answered anew
                elif history is not None and history.done:
                    if await self.takeover.already_done(msg, publisher, history):
                        await self.ack(msg)
                    return
                # Maybe held elsewhere, its start not in the store yet: no proof none started.
                late = None if delivery.maybe_held else too_late(request, found)
                if late is not None:
                    await self.outcomes.reject(msg, late, attempt)
                    return
                writer = self._writer(request, fingerprint, found, delivery)
                release = Release(msg, self.ack)  # the answer is stored: ack
                await self._generate(
                    delivery, request, publisher, writer, queued_ms, release, asked=asked
                )
            finally:
                if asked is not None:
                    await asked.aclose()  # a no-op once the generation closed it

    # -- the steps both paths take -----------------------------------------------------------
    def _admit(self, msg: Msg, request: InferRequest) -> str:
        """The request's scope, once it may run here; raises the typed error of one that will
        never run (:mod:`cloud_node.admission`)."""
        scope = scope_of(msg.subject)
        if scope is None:
            raise InvalidRequestError(
                f"queued on {msg.subject!r}: requests go to mesh.v1.infer.<model>.<scope>",
                request_id=request.id,
            )
        check(request, token_subject(scope, request.id), self.backend.model, self.cancels)
        return scope

    @contextlib.contextmanager
    def _serving(self, delivery: Delivery, request: InferRequest, scope: str) -> Iterator[None]:
        """While a request is served: in :attr:`inflight` (where cancels find it), its logs and
        its trace span named after it."""
        msg, attempt = delivery.msg, delivery.attempt
        address = token_subject(scope, request.id)
        task = asyncio.current_task()
        assert task is not None
        self.inflight[address] = (task, request)
        if delivery.attempt >= self._stream.max_deliver:
            self.last_deliveries.add(task)
        traced = trace_headers(msg.headers)
        traced_id = trace_id(traced.get("traceparent"))
        with bound(
            request_id=request.id,
            node_id=self._ws.node_id,
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
                    yield
            finally:
                # Its own only: a later delivery here (after a stand-still, a copy) runs on.
                if self.inflight.get(address, (None,))[0] is task:
                    del self.inflight[address]
                self.last_deliveries.discard(task)

    def _publisher(self, scope: str, request: InferRequest, fmt: WireFormat) -> AnswerPublisher:
        return AnswerPublisher(
            self.conn, self.store, scope, request.id, fmt, timeout=self._ws.publish_timeout
        )

    def _writer(
        self,
        request: InferRequest,
        fingerprint: str,
        found: AnswerState | Unread | None,
        delivery: Delivery,
    ) -> AnswerWriter:
        """This attempt's writer: it takes over an answer an earlier attempt started (continued
        or started over), numbered after every attempt the store holds. One that another
        attempt may have begun unseen (a delivery another worker may hold, a store that could
        not be read) numbers above any it can reach (:func:`unseen_attempt`). The delivery
        count still decides retries."""
        if found is Unread.STORE:  # an earlier attempt (another copy's) may number so too
            attempt, history = unseen_attempt(delivery.attempt), None
        else:
            attempt, history = delivery.number(), found
        if history is not None and history.started:
            return self.takeover.writer(request, history, max(attempt, history.attempt + 1))
        return AnswerWriter(request.id, attempt=attempt, node=self.node, fingerprint=fingerprint)

    async def _generate(  # noqa: PLR0917
        self,
        delivery: Delivery,
        request: InferRequest,
        publisher: AnswerPublisher,
        writer: AnswerWriter,
        queued_ms: float,
        release: Release,
        renew: Renew | None = None,
        asked: Asked | None = None,
    ) -> None:
        """Generate the answer, publish its events, store its end, and let the message go
        (``release``), reporting progress meanwhile (and calling ``renew`` with the reports,
        see :mod:`cloud_node.progress`). A client's cancel, a shutdown, a lost delivery and a
        failure each end it in exactly one way."""
        msg, attempt = delivery.msg, delivery.attempt
        address = publisher.subject
        writer.delivery = msg.reply  # a survivor hands it back at once if this worker dies
        delivery.generating = True  # from here on, the ways it ends below settle the message
        generating = asyncio.current_task()
        assert generating is not None
        ours = writer.attempt
        keepalive = KeepAlive(
            self.tasks,
            self._stream.ack_wait * self._ws.progress_fraction,
            received=delivery.received,
            newer_attempt=lambda: self._newer_attempt(address, ours),
            connected=lambda: self.conn.connected,
            interrupted=lambda: (
                self.conn.drops != delivery.drops or self.stalls.count() != delivery.stalls
            ),
            msg=msg,
            ack_wait=self._stream.ack_wait,
            generating=generating,
            renew=renew,
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
        # Past its deadline its reader gave up (an edge, the SDK): a client that queued it
        # directly is told, and the engine stops.
        expiry = CancelAt(generating, request.deadline)
        try:
            await publisher.send(writer.start())
            send = publisher.send_now
            gen = await generate_patiently(
                self.backend, request, writer, send, self._ws, asked, patient=last
            )
            expiry.stop()  # generated in time: its end goes out, whatever the clock says
            timings = gen.timings(since=gen.started, queue_ms=queued_ms)
            end = writer.end(
                finish_reason=gen.finish_reason,
                usage=gen.usage,
                timings=timings,
                served_by=self.node,
                routing=request.routing,
            )
            stored = await publisher.finish(end)
            self.counts.republished(publisher)
            if not stored:  # acked all the same; its events still go to the store when it can
                self.settler.later(publisher)
            if await lapsed():  # the delivery may be another worker's: it settles the message
                log.warning("answer done after a lapse; leaving the request to its holder")
            elif not await release.answered(publisher):
                return
            self.counts.served(gen, timings)
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
            if expiry.expired:  # ended typed, like a failure
                answered_cancel()
                if keepalive.stopped or await lapsed():  # its holder now ends it
                    self.counts.outcome("superseded")
                    return
                past = DeadlineExceededError(
                    "the request's deadline passed before its answer ended", request_id=request.id
                )
                await self.outcomes.failed(
                    msg, publisher, writer, past, attempt, keep=release.failed
                )
                return
            if self.cancels.cancels(address, request):
                self.counts.outcome("cancelled")
                log.info("request cancelled by client")
                cancelled = CancelledByClientError("cancelled", request_id=request.id)
                with contextlib.suppress(MeshError, nats.errors.Error):
                    if not await publisher.finish(writer.error(cancelled)):
                        self.settler.later(publisher)  # the store gets it when it can
                    await release.cancelled(cancelled)
                return  # the cancel was ours to act on; the task ends normally
            if keepalive.stopped:  # a newer attempt took it over while this worker stood still
                self.counts.outcome("superseded")
                return
            # Shutdown or a lost lease: give it back so another worker continues it promptly,
            # after what this attempt generated (the next one resumes from the store).
            self.counts.outcome("requeued")
            await self.conn.flush_write_batch()
            if not await lapsed():  # else not ours to give back: its holder continues it
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()
            raise
        except MeshError as err:
            if await lapsed():  # not ours to fail: its holder (or redelivery) continues it
                log.warning("generation failed after a lapse", code=err.code.value)
                return
            await self.outcomes.failed(msg, publisher, writer, err, attempt, keep=release.failed)
        except Exception as exc:  # a bug: answer typed, keep the worker alive
            log.exception("request crashed")
            if await lapsed():
                return
            crash = MeshError(f"worker failure: {type(exc).__name__}", retryable=True)
            await self.outcomes.failed(msg, publisher, writer, crash, attempt, keep=release.failed)
        finally:
            expiry.stop()
            keepalive.stop()
            if self.publishers.get(address) is publisher:  # only its own (see _serving)
                del self.publishers[address]
            if self.settler.publishers.get(address) is not publisher:  # not settling: let go
                publisher.forget()
            if self.keepalives.get(address) is keepalive:
                del self.keepalives[address]

    # -- what the worker asks of the requests being served -----------------------------------
    def alive(self, address: str) -> dict[str, bool]:
        """What this worker says of the request on ``address`` to a reader who asks whether it
        is there: whether it holds it, and whether its engine stands still on it."""
        if address not in self.inflight:
            return {"held": False}
        return {"held": True, "stalled": self.stalled(address)}

    async def resend(self, address: str, attempt: int, seq: int, upto: int | None) -> int:
        """Publish again what a reader of the answer on ``address`` lacks (see
        :meth:`AnswerPublisher.resend`); 0 when this worker holds none of it now."""
        publisher = self.publishers.get(address) or self.settler.publishers.get(address)
        if publisher is None:
            return 0
        return await publisher.resend(attempt, seq, upto)

    def moving(self, within: float = 2.0) -> bool:
        """Whether the engine made a token for any answer within ``within`` seconds."""
        since = time.monotonic() - within
        return any((p.last_token or -1e18) > since for p in self.publishers.values())

    def stalled(self, address: str) -> bool:
        """Whether the engine stands still on this answer: no token for ``report_stall_after``
        after its first, and none for any other answer it generates either (an engine busy with
        others, or one that preempted this answer, still moves: that is slow, not stalled)."""
        publisher = self.publishers.get(address)
        if publisher is None or publisher.last_token is None:
            return False  # before the first token: the edge's first-token timeout judges
        if publisher.finished:
            return False  # generated; only the store's confirmation is awaited
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
        events = await self.store.replay(address, timeout=store_look_timeout(self.settings))
        return any(isinstance(e, StartEvent) and e.attempt > attempt for e in events)
