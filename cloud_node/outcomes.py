"""How a queued request ends when it is not answered: rejected (it will never run), failed
(handed on to another attempt, or ended in a typed error), or out of deliveries (the last
worker died). Each path tells the request's sender, keeps the outcome of a request that can
wait (a rejection and a failure through its own path, :mod:`cloud_node.deferred`, which passes
``keep`` or keeps first), and lets the queue message go only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from cloud_node.counts import WorkerCounts
from cloud_node.delivery import queued_id
from cloud_node.keeper import Keeper
from cloud_node.publisher import AnswerPublisher
from cloud_node.takeover import unseen_attempt
from mesh.answer_store import AnswerStore
from mesh.backends.base import engine_pause
from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.tasks import TaskSet
from protocol.codec import NO_LIMITS, decode_request, error_event, reply_target, sniff
from protocol.errors import ErrorCode, MaxDeliveriesError, MeshError
from protocol.fingerprint import request_fingerprint
from protocol.messages import Answer, ErrorEvent, InferRequest, queued_request_id
from protocol.stream import AnswerState, AnswerWriter
from protocol.subjects import is_token, scope_of, token_subject

log = get_logger(__name__)
MAX_EXHAUSTED = 1000
"""Requests given up on that one worker answers at once (see :meth:`Outcomes.on_max_deliveries`)."""
KEEP_RETRY_FIRST_S = 0.5
KEEP_RETRY_MAX_S = 30.0
"""The pauses between tries to keep the outcome of a request JetStream gave up on: from half a
second, doubling up to 30 s, for as long as the worker runs (its queue message is deleted
after, and with it the last chance to keep anything)."""


async def ack(msg: Msg) -> None:
    """Ack without waiting for the server's confirmation: the outcome is stored already, so
    a lost ack only means a redelivery, which finds the outcome and acks it without
    generating again. (Waiting cost a round trip and ~10% of the worker's CPU per request.)"""
    try:
        await msg.ack()
    except nats.errors.Error as exc:
        log.warning("ack not sent", error=repr(exc))


async def nothing_to_keep(_err: MeshError) -> bool:
    """A request that cannot wait keeps nothing besides its answer stream: let it go."""
    return True


class Outcomes:
    def __init__(
        self,
        conn: Connection,
        store: AnswerStore,
        keeper: Keeper,
        stream: StreamSettings,
        *,
        node: str,
        publish_timeout: float,
        counts: WorkerCounts,
        settle: Callable[[AnswerPublisher], None] = lambda _publisher: None,
    ) -> None:
        self.conn = conn
        self.store = store
        self.keeper = keeper
        self.stream = stream
        self.settle = settle
        """Called with a publisher whose final error the store could not confirm."""
        self.node = node
        self.publish_timeout = publish_timeout
        self.counts = counts
        """Where rejections, failures (with their codes) and max_deliveries are counted."""
        self.stopping = False
        self.exhausted = TaskSet("worker-exhausted")
        """The requests JetStream gave up on being answered, each in a task: one whose keep
        waits for the hub holds up no other (the advisories' callbacks run one at a time)."""
        self._ending: set[int] = set()  # queue sequences being ended now (given up on)

    async def reject(self, msg: Msg, err: MeshError, attempt: int) -> None:
        """Answer a request that will never run, where its sender listens, and drop it for good.
        Never raises: a message it cannot read is still terminated."""
        try:
            request_id, _reply = reply_target(msg.data, msg.headers, queued_id(msg))
            if err.request_id is not None and is_token(err.request_id):
                request_id = err.request_id
            self.counts.outcome("rejected", err.code.value)
            log.warning(
                "request rejected",
                code=err.code.value,
                error=err.message,
                request_id=request_id,
                subject=msg.subject,
                answered=request_id is not None and scope_of(msg.subject) is not None,
            )
            scope = scope_of(msg.subject)
            if request_id is not None and scope is not None:
                publisher = AnswerPublisher(
                    self.conn,
                    self.store,
                    scope,
                    request_id,
                    sniff(msg.data, msg.headers).reply_format,
                    timeout=self.publish_timeout,
                )
                writer = AnswerWriter(request_id, attempt=attempt, node=self.node)
                with contextlib.suppress(MeshError):
                    if not await publisher.finish(writer.error(err)):
                        self.settle(publisher)  # the store gets it when it can
        except Exception:  # answering is best effort; terminating is not
            log.exception("answering a rejected request failed")
        with contextlib.suppress(nats.errors.Error):
            if err.code is ErrorCode.CANCELLED:
                await msg.ack()
            else:
                await msg.term()

    async def failed(
        self,
        msg: Msg,
        publisher: AnswerPublisher,
        writer: AnswerWriter,
        err: MeshError,
        attempt: int,
        *,
        keep: Callable[[MeshError], Awaitable[bool]] = nothing_to_keep,
    ) -> None:
        """A generation failed: handed on to another attempt while deliveries are left, else
        ended in a typed error. ``keep`` keeps that final error before the message is let go
        (a request that can wait: for its site); False when it handed the message back
        instead."""
        self.counts.outcome("failed", err.code.value)
        if err.retryable and attempt < self.stream.max_deliver:
            # Another attempt continues from what the store kept of ours.
            log.warning("generation failed; handing it on", code=err.code.value, error=err.message)
            with contextlib.suppress(MeshError):
                await publisher.catch_up()
            with contextlib.suppress(nats.errors.Error):  # after the engine's Retry-After
                await msg.nak(delay=engine_pause(err.retry_after) or 1.0)
            return
        if err.retryable:
            err = MaxDeliveriesError(
                f"failed on {attempt} deliveries; last error: {err.message}",
                request_id=writer.request_id,
                retryable=False,
            )
        log.warning("generation failed", code=err.code.value, error=err.message)
        with contextlib.suppress(MeshError):
            if not await publisher.finish(writer.error(err)):
                self.settle(publisher)  # live readers have it; the store gets it when it can
        if not await keep(err):
            return
        with contextlib.suppress(nats.errors.Error):
            await msg.term()

    async def kept_or_nak(
        self, msg: Msg, scope: str, request: InferRequest, outcome: ErrorEvent
    ) -> bool:
        """Keep a request-that-can-wait's final error before its message is let go; when it
        cannot be kept, hand the message back (False) so a later delivery keeps it."""
        return await self.keeper.keep_or_hand_back(
            msg, scope, request, None, outcome, what="final error"
        )

    async def _keep_patiently(
        self, scope: str, request: InferRequest, outcome: Answer | ErrorEvent
    ) -> None:
        """Keep the final outcome of a request that can wait, trying until it is kept (a hub
        restarting, an election): the queue message is deleted after this, and with it the last
        chance to keep anything. Before, it gave up after 3.5 s, and the site never heard."""
        pause = KEEP_RETRY_FIRST_S
        while True:
            try:
                await self.keeper.keep(scope, request, None, outcome)
                return
            except MeshError as err:
                log.warning("final outcome not kept; trying again", error=err.message, pause=pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, KEEP_RETRY_MAX_S)

    async def on_max_deliveries(self, msg: Msg) -> None:
        """JetStream's advisory, heard on its subject (a worker whose credentials predate the
        stream ``MESH_GIVEN_UP``: :mod:`cloud_node.given_up`): ended in a task of its own (at
        most ``MAX_EXHAUSTED`` at once: beyond, here), trying for as long as the worker runs,
        the advisory being the only word of it."""
        if self.stopping:
            return  # the worker stops: its tasks are closed (it leaves the group next)
        if len(self.exhausted) < MAX_EXHAUSTED:
            self.exhausted.spawn(self.end_given_up(msg, patient=True), name="max-deliveries")
        else:
            await self.end_given_up(msg, patient=True)

    async def end_given_up(self, msg: Msg, *, patient: bool = False) -> bool:
        """The last delivery's worker died (``msg``: JetStream's advisory): tell the request's
        sender, typed, keep its outcome when it can wait, and drop it. True when it is ended, or
        nothing is left to end (its queued message gone); False when it cannot be now and
        should be tried again (read from the stream: handed back, read again later)."""
        try:
            advisory = json.loads(msg.data)
            stream_seq = int(advisory["stream_seq"])
            deliveries = int(advisory.get("deliveries", self.stream.max_deliver))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("max-deliveries advisory unreadable; dropped", error=repr(exc))
            return True
        if stream_seq in self._ending:  # a second advisory of it: read again once this ends
            return False
        self._ending.add(stream_seq)
        jsm = self.conn.jsm()
        try:
            try:
                queued = await jsm.get_msg(self.stream.name, stream_seq)
            except NotFoundError:
                return True  # ended already (or expired from the queue): nothing to do
            data, headers, subject = queued.data or b"", queued.headers, queued.subject or ""
            await self._end_exhausted(
                stream_seq, deliveries, data, headers, subject, patient=patient
            )
            with contextlib.suppress(NotFoundError):
                await jsm.delete_msg(self.stream.name, stream_seq)
        except Exception as exc:  # the store or the queue cannot be read now
            log.info("max-deliveries advisory not handled", error=repr(exc))
            return False
        finally:
            self._ending.discard(stream_seq)
        return True

    async def _end_exhausted(
        self,
        stream_seq: int,
        deliveries: int,
        data: bytes,
        headers: dict[str, str] | None,
        subject: str,
        *,
        patient: bool,
    ) -> None:
        """End the queued request (``data``, ``headers``, on ``subject``) whose ``deliveries``
        all ended without an answer: its stored outcome or ``max_deliveries``, kept for its site
        when it can wait (``patient``: trying until it is kept; else once, raising when it
        cannot be), told to its readers."""
        missing_id = queued_request_id(stream_seq)
        request_id, _ = reply_target(data, headers, missing_id)
        scope = scope_of(subject)
        try:
            held: InferRequest | None = decode_request(
                data, headers, limits=NO_LIMITS, missing_id=missing_id
            )[0]
        except MeshError:
            held = None
        state: AnswerState | None = None
        if request_id is not None and scope is not None:
            # Read as the request's own: another request's answer under a reused id is a
            # duplicate, never kept as this one's (review S20b).
            fingerprint = request_fingerprint(held) if held is not None else None
            state = AnswerState(request_id, fingerprint=fingerprint)
            try:
                state.feed_all(await self.store.replay(token_subject(scope, request_id)))
            except MeshError as err:  # its readers hear the error all the same (below)
                log.warning("answer store not read; ending the request", error=err.message)
                state = AnswerState(request_id)
        if held is not None and held.deferrable and scope and held.id == request_id:
            # The last worker may have stored the whole answer (or a final error) and
            # died before keeping it: that outcome is the request's, not this one.
            stored = state.whole() if state is not None else None
            exhausted = MaxDeliveriesError(
                f"{deliveries} deliveries ended without an answer", request_id=held.id
            )
            outcome = stored or error_event(exhausted, held.id)
            if patient:
                await self._keep_patiently(scope, held, outcome)
            else:
                await self.keeper.keep(scope, held, None, outcome)
        if request_id is not None and scope is not None and state is not None and not state.done:
            fmt = sniff(data, headers).reply_format
            publisher = AnswerPublisher(
                self.conn,
                self.store,
                scope,
                request_id,
                fmt,
                timeout=self.publish_timeout,
            )
            # Above every attempt the store holds (a second copy of a request that can
            # wait numbers after the first's), and above any a worker numbered unseen
            # whose start a reader has and the store lost (its deliveries were these), so
            # readers take it as the newest.
            attempt = max(deliveries, state.attempt, unseen_attempt(deliveries + 1))
            writer = AnswerWriter(request_id, attempt=attempt)
            exhausted = MaxDeliveriesError(
                f"{deliveries} deliveries ended without an answer (workers stopped mid-request)",
                request_id=request_id,
                retryable=False,
            )
            if not await publisher.finish(writer.error(exhausted)):
                self.settle(publisher)  # the store gets it when it can
            self.counts.max_deliveries()
            log.warning("request exhausted its deliveries", request_id=request_id)
