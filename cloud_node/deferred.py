"""Serving a request that can wait (``deferrable``): its own path, beside the plain one.

Such a request's site is not listening while it is answered: it collects the outcome later,
from where the worker keeps it (:mod:`cloud_node.keeper`). And it may sit in the queue twice (a
site's forward retried after the queue's dedupe window), both copies under one token subject.
So its path, :meth:`DeferrableHandler.serve_deferrable`, takes the plain path's steps
(:mod:`cloud_node.serve`) with these rules of its own:

- **One copy answers.** Before generating, the copy takes the request's lease
  (:mod:`cloud_node.lease`), and renews it with its progress reports. A copy that finds another
  being answered, or the answer kept already, is acked without generating; a copy whose lease
  is taken from it is handed back.
- **Kept before acked.** Every outcome is kept for the site before the message is let go: the
  answer, a stored outcome found on a redelivery, a rejection, a final error, a client's cancel
  (asked for again by id, it says so). When it cannot be kept, the message is handed back and
  a later delivery keeps it (:class:`KeepFirst`).
- **Looked up on its first delivery too.** Another copy may have begun the answer: this attempt
  numbers after it. A copy that cannot read the store cannot see such a start: it numbers its
  attempt above anything the store can hold (:func:`unseen_attempt`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from cloud_node.counts import WorkerCounts
from cloud_node.delivery import Ack, Delivery, Release, queued_id
from cloud_node.keeper import Keeper
from cloud_node.lease import OTHER_COPY, Holding, Lease, Leases
from cloud_node.outcomes import Outcomes
from cloud_node.publisher import AnswerPublisher
from cloud_node.serve import Handler, Parts
from cloud_node.takeover import Unread, is_duplicate, too_late
from mesh.config import MeshSettings
from mesh.logs import get_logger
from protocol.codec import NO_LIMITS, WireFormat, decode_request, error_event
from protocol.errors import MeshError
from protocol.fingerprint import request_fingerprint
from protocol.messages import InferRequest
from protocol.stream import AnswerState
from protocol.subjects import scope_of

log = get_logger(__name__)
KeepAnswer = Callable[[Msg, str, InferRequest, AnswerPublisher], Awaitable[bool]]
"""Keeps a finished answer for its site, or hands the message back (False)."""


class KeepFirst(Release):
    """Lets the message of a request that can wait go only once its outcome is kept for its
    site; when it cannot be kept, the message is handed back, and a later delivery keeps it."""

    def __init__(  # noqa: PLR0917
        self,
        msg: Msg,
        ack: Ack,
        keep_answer: KeepAnswer,
        keeper: Keeper,
        outcomes: Outcomes,
        scope: str,
        request: InferRequest,
    ) -> None:
        super().__init__(msg, ack)
        self.keep_answer = keep_answer
        self.keeper = keeper
        self.outcomes = outcomes
        self.scope = scope
        self.request = request

    async def answered(self, publisher: AnswerPublisher) -> bool:
        if not await self.keep_answer(self.msg, self.scope, self.request, publisher):
            return False
        return await super().answered(publisher)

    async def cancelled(self, err: MeshError) -> None:
        # Asked for again by id, it says so. Not kept: the message is not acked, and its
        # redelivery is refused, kept and answered.
        await self.keeper.keep(self.scope, self.request, None, error_event(err, self.request.id))
        await super().cancelled(err)

    async def failed(self, err: MeshError) -> bool:
        return await self.outcomes.kept_or_nak(
            self.msg, self.scope, self.request, error_event(err, self.request.id)
        )


class DeferrableHandler(Handler):
    """The worker's handler: the plain path (:class:`cloud_node.serve.Handler`), and beside it
    the path of requests that can wait, with the two parts only that path uses."""

    def __init__(
        self,
        settings: MeshSettings,
        parts: Parts,
        counts: WorkerCounts,
        *,
        keeper: Keeper,
        leases: Leases,
    ) -> None:
        super().__init__(settings, parts, counts)
        self.keeper = keeper
        self.leases = leases

    async def serve_deferrable(
        self, delivery: Delivery, request: InferRequest, fmt: WireFormat
    ) -> None:
        """A request that can wait, from its delivery to its ack, its outcome kept first."""
        msg, attempt = delivery.msg, delivery.attempt
        try:
            scope = self._admit(msg, request)
        except MeshError as err:
            await self.refuse(msg, scope_of(msg.subject), request, err, delivery.number())
            return
        with self._serving(delivery, request, scope):
            queued_ms = delivery.queued_ms()
            publisher = self._publisher(scope, request, fmt)
            fingerprint = request_fingerprint(request)  # once: a hash of the whole conversation
            copy = msg.metadata.sequence.stream
            claimed = await self._claim(scope, request, copy, fingerprint)
            if claimed == OTHER_COPY:  # that copy is still queued, or its answer is kept
                self.counts.outcome("other_copy")
                log.info("another copy of this request is being answered; acking this one")
                await self.ack(msg)
                return
            holding = Holding(
                self.leases,
                claimed if isinstance(claimed, Lease) else None,
                lambda copy, fingerprint: self._claim(scope, request, copy, fingerprint),
            )
            found = await self._history(request, fingerprint, publisher.subject)
            history = None if found is Unread.STORE else found
            if history is not None and history.done:
                duplicate = history.outcome  # another request's answer under this id
                if is_duplicate(duplicate) and not await self.outcomes.kept_or_nak(
                    msg, scope, request, duplicate
                ):
                    return  # kept first (it was refused and kept nothing: review S20b)
                if await self.takeover.already_done(
                    msg, publisher, history
                ) and await self._keep_stored(msg, scope, request, publisher):
                    await self.ack(msg)
                return
            if await self.keeper.exists(scope, request.id):
                # Forwarded again after its answer was kept (a flap outlived the dedupe window).
                self.counts.outcome("already_done")
                log.info("answer already kept; acking without generating")
                await self.ack(msg)
                return
            # Maybe held elsewhere, its start not in the store yet: no proof none started.
            late = None if delivery.maybe_held else too_late(request, found)
            if late is not None:
                await self.refuse(msg, scope, request, late, attempt)
                return
            # After every attempt the store holds, another copy's too; above any, unseen, when
            # the store could not be read (see unseen_attempt).
            writer = self._writer(request, fingerprint, found, delivery)
            release = KeepFirst(
                msg, self.ack, self._keep, self.keeper, self.outcomes, scope, request
            )
            await self._generate(
                delivery, request, publisher, writer, queued_ms, release, holding.renew
            )

    async def refuse_undecoded(self, msg: Msg, err: MeshError, attempt: int) -> None:
        """A request that can wait, refused as this worker decoded it (over its limits, a field
        it does not know): its typed error is kept for its site first, as any refusal's. It was
        not: the site's client waited, then heard "ask again" for ever (review S20b)."""
        scope = scope_of(msg.subject)
        try:  # read again without this worker's limits: what the site sent, to keep for it
            request: InferRequest | None = decode_request(
                msg.data, msg.headers, limits=NO_LIMITS, missing_id=queued_id(msg)
            )[0]
        except MeshError:
            request = None
        if request is not None and request.deferrable and scope is not None:
            await self.refuse(msg, scope, request, err, attempt)
        else:
            await self.outcomes.reject(msg, err, attempt)

    async def _history(
        self, request: InferRequest, fingerprint: str, subject: str
    ) -> AnswerState | Unread | None:
        """What earlier attempts left in the answer store, on a first delivery too: this may
        be a second copy of a request another copy began. :attr:`Unread.STORE` when the store
        cannot be read; None when there is none."""
        try:
            return await self.takeover.read(request.id, fingerprint, subject)
        except MeshError as err:
            log.warning("cannot read the answer store; starting over", error=err.message)
            return Unread.STORE

    async def refuse(
        self, msg: Msg, scope: str | None, request: InferRequest, err: MeshError, attempt: int
    ) -> None:
        """Reject a request that will never run, its final error kept for its site first (when
        it cannot be kept, the message is handed back: a later delivery keeps it)."""
        if scope is not None and not await self.outcomes.kept_or_nak(
            msg, scope, request, error_event(err, request.id)
        ):
            return
        await self.outcomes.reject(msg, err, attempt)

    async def _keep(
        self, msg: Msg, scope: str, request: InferRequest, publisher: AnswerPublisher
    ) -> bool:
        """Keep a finished answer for its site; False when it cannot be kept now. The message
        is then handed back, not failed (its answer is out already): a later delivery finds it
        done and keeps it without generating again."""
        kept = await self.keeper.keep_or_hand_back(msg, scope, request, publisher, what="answer")
        if not kept:
            self.counts.outcome("requeued")
        return kept

    async def _keep_stored(
        self, msg: Msg, scope: str, request: InferRequest, publisher: AnswerPublisher
    ) -> bool:
        """Keep the outcome an earlier attempt stored (its ack was lost); False when it cannot
        be kept now: handed back at once, the next delivery keeps it."""
        return await self.keeper.keep_or_hand_back(
            msg, scope, request, publisher, what="stored outcome"
        )

    async def _claim(
        self, scope: str, request: InferRequest, copy: int, fingerprint: str
    ) -> Lease | str | None:
        """The lease for queued copy ``copy`` (see :meth:`Leases.claim`); a copy whose answer is
        kept already counts as answered."""
        return await self.leases.claim(
            scope, request.id, copy, fingerprint, lambda: self.keeper.exists(scope, request.id)
        )
