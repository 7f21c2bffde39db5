"""What earlier attempts of a request left in the answer store, and what a new delivery does
with it: continue the answer from the stored prefix, start it over, or (when the outcome is
stored already) make that outcome final without generating again.

Both paths of :mod:`cloud_node.serve` use it; a request that can wait reads the store by its own
rule too (:mod:`cloud_node.deferred`: a second copy looks on its first delivery)."""

from __future__ import annotations

import contextlib
import time
from enum import Enum
from typing import TypeGuard

import nats.errors
from nats.aio.msg import Msg

from cloud_node.counts import WorkerCounts
from cloud_node.publisher import AnswerPublisher
from mesh.answer_store import AnswerStore
from mesh.logs import get_logger
from protocol.errors import DeadlineExceededError, ErrorCode, MeshError
from protocol.messages import EndEvent, ErrorEvent, InferRequest, StartEvent
from protocol.stream import AnswerState, AnswerWriter, Resume

log = get_logger(__name__)


SKEW_MARGIN_US = 60_000_000
"""A minute, in microseconds: each later delivery of a message numbers this much above what
:func:`unseen_attempt` gives, so it outranks an earlier delivery of the same message numbered
so on a worker whose clock ran up to a minute ahead. Only within one message's deliveries: a
copy queued anew, or a consumer made anew, counts its deliveries from 1 again, and then only
the store read first (what a copy's delivery does) orders it after an earlier chain's."""


def unseen_attempt(deliveries: int = 1) -> int:
    """An attempt number above any the answer store can hold: microseconds since the epoch
    (about 1.8e15, exact in JSON's doubles too), plus :data:`SKEW_MARGIN_US` for each delivery
    before this one. Given to an attempt that another may be generating unseen, numbered from 1:
    a delivery that could not read the store (another copy of a request that can wait, an
    earlier attempt of one that cannot), or one another worker may hold already (a copy its
    sender queued again, :data:`mesh.queue.COPY_HEADER`; a message older than its consumer,
    :mod:`cloud_node.epoch`). Numbered alike, readers would take the two attempts for one and
    mix their tokens. Numbered above, this attempt's start is the newest: readers go on with it
    (or start over), and drop the other's later events. Attempts that read the store later
    number after it."""
    return time.time_ns() // 1000 + (deliveries - 1) * SKEW_MARGIN_US


class Unread(Enum):
    """What a delivery finds when the answer store cannot be read: an earlier attempt, or
    another queued copy, may have begun the answer, unseen."""

    STORE = "the answer store could not be read"


class Takeover:
    def __init__(
        self,
        store: AnswerStore,
        *,
        node: str,
        continues: bool,
        counts: WorkerCounts,
        timeout: float | None = None,
    ) -> None:
        self.store = store
        self.timeout = timeout
        """Longest wait on one read of the store (None: the connection's request timeout)."""
        self.node = node
        """This worker, as events name it (``cloud:<node_id>``)."""
        self.continues = continues
        """Whether the backend can continue an answer from a prefix."""
        self.counts = counts
        """Where takeovers (``continued``, ``restarted``) and ``already_done`` are counted."""

    async def read(self, request_id: str, fingerprint: str, subject: str) -> AnswerState | None:
        """What earlier attempts left in the answer store under ``subject`` (None when there is
        no store). Raises :class:`MeshError` when it cannot be read."""
        if not self.store.enabled:
            return None
        events = await self.store.replay(subject, timeout=self.timeout)
        state = AnswerState(request_id, fingerprint=fingerprint)
        state.feed_all(events)
        return state

    async def _ended(self, subject: str) -> bool:
        """Whether the answer stored under ``subject`` has its outcome (an end or an error)
        after its last start: one begun since an earlier one ended is under way."""
        ended = False
        for event in await self.store.replay(subject, timeout=self.timeout):
            if isinstance(event, StartEvent):
                ended = False
            elif isinstance(event, EndEvent | ErrorEvent):
                ended = True
        return ended

    async def history(
        self, request: InferRequest, fingerprint: str, subject: str, *, look: bool
    ) -> AnswerState | Unread | None:
        """What earlier attempts left, for a redelivery or a delivery another worker may hold
        (``look``; None otherwise, or without a store; :attr:`Unread.STORE` when the store
        cannot be read: then the answer starts over)."""
        if not look:
            return None
        try:
            return await self.read(request.id, fingerprint, subject)
        except MeshError as err:
            log.warning("cannot read the answer store; starting over", error=err.message)
            return Unread.STORE

    def writer(self, request: InferRequest, history: AnswerState, attempt: int) -> AnswerWriter:
        """The writer of a delivery that takes over a started answer: it continues from the
        stored prefix, or starts over when the backend cannot continue."""
        # A constrained answer (JSON, a schema) cannot resume mid-text: its grammar starts over.
        constrained = request.response_format is not None and request.response_format.type != "text"
        resume = history.resume() if self.continues and not constrained else Resume()
        self.counts.takeover("continued" if resume.seq > 0 else "restarted")
        if resume.seq > 0:
            reason = f"continued after {history.node or 'a worker'} stopped"
        else:
            reason = "redelivered; started over"
        log.info(
            "taking over a request",
            resumed_at=resume.seq,
            kept_tokens=resume.tokens,
            previous=history.node,
            reason=reason,
        )
        return AnswerWriter(
            request.id,
            attempt=attempt,
            node=self.node,
            fingerprint=history.fingerprint,
            resume=resume,
            reason=reason,
        )

    async def already_done(
        self, msg: Msg, publisher: AnswerPublisher, history: AnswerState
    ) -> bool:
        """The answer's outcome is stored: an earlier attempt finished but its ack was lost.
        Never generate a second answer. True when that outcome is the request's, to be made
        final (the caller lets the message go); False when the store holds another request's
        answer under this id: refused here, the message terminated."""
        self.counts.outcome("already_done")
        outcome = history.outcome
        if is_duplicate(outcome):
            # Our own check: the store holds another request's answer under this id. Said on
            # the token subject only once that answer ended: until then its readers, who share
            # the subject, would take the error for their own (an error names no request).
            log.warning("request id reused for other content; refusing it")
            with contextlib.suppress(MeshError):
                if await self._ended(publisher.subject):
                    await publisher.finish(outcome)
            with contextlib.suppress(nats.errors.Error):
                await msg.term()
            return False
        log.info("outcome already stored; acking without generating")
        return True


def is_duplicate(outcome: object) -> TypeGuard[ErrorEvent]:
    """The outcome the store holds is our own check's: another request's answer under the id."""
    return isinstance(outcome, ErrorEvent) and outcome.code == ErrorCode.DUPLICATE.value


def too_late(request: InferRequest, history: AnswerState | Unread | None) -> MeshError | None:
    """The error of a request no worker started before its ``start_by`` (one that an earlier
    attempt started is continued past it). A store that could not be read is no proof that
    nothing started: such a request is started over, not refused."""
    if history is Unread.STORE:
        return None
    started_before = history is not None and history.started
    if started_before or not request.past_start_by():
        return None
    return DeadlineExceededError(
        "no worker could start the request before its start_by time", request_id=request.id
    )
