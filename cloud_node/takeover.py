"""What earlier attempts of a request left in the answer store, and what a new delivery does
with it: continue the answer from the stored prefix, start it over, or (when the outcome is
stored already) make that outcome final without generating again."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import nats.errors
from nats.aio.msg import Msg

from cloud_node.keeper import Keeper
from cloud_node.publisher import AnswerPublisher
from mesh.answer_store import AnswerStore
from mesh.logs import get_logger
from protocol.errors import ErrorCode, MeshError
from protocol.messages import ErrorEvent, InferRequest
from protocol.stream import AnswerState, AnswerWriter, Resume

log = get_logger(__name__)


class Unread(Enum):
    """What :meth:`Takeover.history` finds for a request that can wait when the answer store
    cannot be read: another queued copy may have begun the answer, unseen."""

    STORE = "the answer store could not be read"


def unseen_attempt() -> int:
    """An attempt number above any the answer store can hold: microseconds since the epoch
    (about 1.8e15, exact in JSON's doubles too). Given to a copy of a request that can wait
    which could not read the store: another copy may have begun the answer unseen, numbered
    from 1, and readers would take two attempts numbered alike for one and mix their tokens.
    Numbered above, this attempt's start is the newest: readers start over with it, and drop
    the other copy's later events. Attempts that read the store later number after it."""
    return time.time_ns() // 1000


class Takeover:
    def __init__(
        self,
        store: AnswerStore,
        keeper: Keeper,
        *,
        node: str,
        continues: bool,
        count: Callable[..., None],
        stats: Any,
        takeovers: Any,
        ack: Callable[[Msg], Awaitable[None]],
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.node = node
        """This worker, as events name it (``cloud:<node_id>``)."""
        self.continues = continues
        """Whether the backend can continue an answer from a prefix."""
        self.count = count
        """Counts a delivery's outcome (stats and Prometheus)."""
        self.stats = stats
        """The worker's stats: ``continued`` and ``restarted`` are counted here."""
        self.takeovers = takeovers
        """The Prometheus counter of takeovers, by kind."""
        self.ack = ack

    async def history(
        self, request: InferRequest, fingerprint: str, publisher: AnswerPublisher, attempt: int
    ) -> AnswerState | Unread | None:
        """What earlier attempts left in the answer store (None on a first delivery of a request
        that cannot wait, or when the store cannot be read: then the answer starts over). A
        request that can wait is looked up on its first delivery too: it may be a second copy of
        one another copy began; when the store cannot be read, :attr:`Unread.STORE` says so."""
        if (attempt == 1 and not request.deferrable) or not self.store.enabled:
            return None
        try:
            events = await self.store.replay(publisher.subject)
        except MeshError as err:
            log.warning("cannot read the answer store; starting over", error=err.message)
            return Unread.STORE if request.deferrable else None
        state = AnswerState(request.id, fingerprint=fingerprint)
        state.feed_all(events)
        return state

    def writer(self, request: InferRequest, history: AnswerState, attempt: int) -> AnswerWriter:
        """The writer of a delivery that takes over a started answer: it continues from the
        stored prefix, or starts over when the backend cannot continue."""
        # A constrained answer (JSON, a schema) cannot resume mid-text: its grammar starts over.
        constrained = request.response_format is not None and request.response_format.type != "text"
        resume = history.resume() if self.continues and not constrained else Resume()
        kind = "continued" if resume.seq > 0 else "restarted"
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        self.takeovers.labels(kind=kind).inc()
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
        self,
        msg: Msg,
        publisher: AnswerPublisher,
        history: AnswerState,
        request: InferRequest,
        scope: str,
    ) -> None:
        """The answer's outcome is stored: an earlier attempt finished but its ack was lost.
        Never generate a second answer; just make the outcome final."""
        self.count("already_done")
        outcome = history.outcome
        if isinstance(outcome, ErrorEvent) and outcome.code == ErrorCode.DUPLICATE.value:
            # Our own check: the store holds another request's answer under this id.
            log.warning("request id reused for other content; refusing it")
            with contextlib.suppress(MeshError):
                await publisher.finish(outcome)
            with contextlib.suppress(nats.errors.Error):
                await msg.term()
            return
        log.info("outcome already stored; acking without generating")
        if request.deferrable:
            try:
                await self.keeper.keep(scope, request, publisher)
            except MeshError as err:  # handed back at once: the next delivery keeps it
                log.warning("stored outcome not kept; redelivering", error=err.message)
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak(delay=1.0)
                return
        await self.ack(msg)
