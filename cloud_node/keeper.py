"""Keeping the whole answer of a request that could wait, where its edge site collects it.

Before it acks a ``deferrable`` request, the worker stores its outcome (the verified text, or
the typed error) on ``mesh.v1.ans.<scope>.<id>`` in the hub's stream ``MESH_ANSWERS``, under a
message id, so a retried keep is stored once. A request forwarded again after its answer was
kept (a site's forward retried past the queue's dedupe window) is acked without generating.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from cloud_node.publisher import AnswerPublisher
from mesh import kept
from mesh.answer_store import AnswerStore
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.write_batch import room
from protocol.codec import error_event
from protocol.errors import MeshError, PayloadTooLargeError
from protocol.fingerprint import request_fingerprint
from protocol.messages import Answer, ErrorEvent, InferRequest, StartEvent, WireEvent
from protocol.subjects import ANSWERS_STREAM, answer_subject

log = get_logger(__name__)


RESTORED_WITHIN_S = 1.0
"""How long a keep that found ``MESH_ANSWERS`` gone waits for the worker to put it back before
it tries once more (then it hands the request back, 1 s, as any keep that fails)."""


class AnswersGone(MeshError):
    """``MESH_ANSWERS`` is not there (deleted, a hub restarted on an empty store)."""


class Keeper:
    def __init__(
        self,
        conn: Connection,
        store: AnswerStore,
        timeout: float,
        on_lost: Callable[[str], None] | None = None,
        restored: Callable[[float], Awaitable[bool]] | None = None,
        *,
        look: float | None = None,
    ) -> None:
        self.conn = conn
        self.store = store
        self.timeout = timeout
        self.look = timeout if look is None else look
        """How long :meth:`exists` waits: a worker looks while it holds a delivery."""
        self._on_lost = on_lost
        """Told when the hub's answer store is gone (a kept answer's publish, or its site's
        consumer, found no stream): the worker puts its streams back now."""
        self._restored = restored
        """Waits up to the given seconds for what ``on_lost`` started; whether it is back."""
        self._made: set[str] = set()
        """Scopes whose site consumer this worker has made (see :meth:`collectable`)."""

    async def collectable(self, scope: str) -> None:
        """Make sure the site of ``scope`` has its consumer on ``MESH_ANSWERS`` (idempotent),
        at every keep. A worker that made sure once per site and process never put back a
        consumer deleted since (``nats consumer rm``, a hub that restarted with an empty
        store), and the site collected nothing more. When it cannot now for another reason
        than a missing stream (a timeout, the cluster electing its meta leader) and it has
        made the consumer before, the answer is kept anyway: a consumer made again later
        delivers from the stream's first answer, and a keep refused for it would cost the
        request one of its deliveries. Raises a retryable :class:`MeshError` otherwise."""
        try:
            await asyncio.wait_for(
                self.conn.jsm().add_consumer(ANSWERS_STREAM, kept.site_consumer_config(scope)),
                self.timeout,
            )
        except (asyncio.TimeoutError, nats.errors.Error, APIError) as exc:
            if isinstance(exc, NotFoundError):  # the stream
                self._lost(exc)
                raise AnswersGone(f"{ANSWERS_STREAM} is gone", retryable=True) from None
            if scope in self._made:
                log.warning("site consumer not made sure of; keeping anyway", error=repr(exc))
                return
            raise MeshError(
                f"cannot make the site's answers collectable: {type(exc).__name__}",
                retryable=True,
            ) from None
        self._made.add(scope)

    def _lost(self, exc: Exception) -> None:
        if self._on_lost is not None:
            self._on_lost(f"{ANSWERS_STREAM} is gone: {type(exc).__name__}")

    async def keep_or_hand_back(
        self,
        msg: Msg,
        scope: str,
        request: InferRequest,
        publisher: AnswerPublisher | None,
        outcome: Answer | ErrorEvent | None = None,
        *,
        what: str,
    ) -> bool:
        """:meth:`keep`, or, when it cannot keep now, hand the queue message back (a nak, 1 s):
        a later delivery finds the outcome stored and keeps it. The one rule for every keep
        before a deferrable request's message is let go; ``what`` names it in the log. A keep
        that found ``MESH_ANSWERS`` gone first waits for the worker to put it back, and tries
        once more (a deleted stream cost the answer the 1 s hand-back before)."""
        try:
            try:
                await self.keep(scope, request, publisher, outcome)
            except AnswersGone:
                if self._restored is None or not await self._restored(RESTORED_WITHIN_S):
                    raise
                await self.keep(scope, request, publisher, outcome)
        except MeshError as err:
            log.warning(f"{what} not kept; handing the request back", error=err.message)
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=1.0)
            return False
        return True

    async def _events(self, publisher: AnswerPublisher) -> list[WireEvent]:
        """The answer's events: what the store holds (every attempt's), or, when the store
        cannot be read and this attempt began the answer, the events this attempt sent."""
        sent = publisher.sent()
        if not self.store.enabled:
            return sent
        try:
            return await self.store.replay(publisher.subject)
        except MeshError:
            began = bool(sent) and isinstance(sent[0], StartEvent) and sent[0].seq == 0
            if not began:  # a continuation: its own events lack the answer's beginning
                raise
            return sent

    async def exists(self, scope: str, request_id: str) -> bool:
        """True when the request's answer is kept already (False when that cannot be told:
        answering again is safe, the site keeps one answer per id)."""
        try:
            await self.conn.jsm(self.look).get_msg(
                ANSWERS_STREAM, subject=answer_subject(scope, request_id), direct=True
            )
        except NotFoundError:
            return False
        except (asyncio.TimeoutError, nats.errors.Error, APIError):
            return False
        return True

    async def keep(
        self,
        scope: str,
        request: InferRequest,
        publisher: AnswerPublisher | None,
        outcome: Answer | ErrorEvent | None = None,
    ) -> None:
        """Store ``outcome``, or the outcome of what ``publisher``'s answer store holds (every
        attempt's events, so a continued answer is kept whole), with the request's fingerprint
        (header ``Mesh-Req``), so the site never hands it to another request under the same id.
        Raises a retryable :class:`MeshError` when it cannot: the request is then not acked."""
        request_id = request.id
        if outcome is None and publisher is not None:
            events = await self._events(publisher)
            outcome = kept.whole_answer(events, request_id, request_fingerprint(request))
        if outcome is None:
            raise MeshError("the answer's stored events hold no outcome", retryable=True)
        data = kept.encode_outcome(outcome)
        if len(data) > room(self.conn.nc):  # never kept as it is: its typed error is, for good
            too_large = PayloadTooLargeError(
                f"the answer is {len(data)} bytes, over the {room(self.conn.nc)} one kept answer "
                "can carry: ask for it streamed, not deferred",
                request_id=request_id,
            )
            data = kept.encode_outcome(error_event(too_large, request_id))
        await self.collectable(scope)
        try:
            await self.conn.publish_acked(
                answer_subject(scope, request_id),
                data,
                stream=ANSWERS_STREAM,
                headers={
                    kept.MSG_ID_HEADER: f"{scope}.{request_id}",
                    kept.FINGERPRINT_HEADER: request_fingerprint(request),
                },
                timeout=self.timeout,
            )
        except (asyncio.TimeoutError, nats.errors.Error, APIError) as exc:
            if isinstance(exc, NoStreamResponseError):
                self._lost(exc)
                raise AnswersGone(f"{ANSWERS_STREAM} is gone", retryable=True) from None
            raise MeshError(
                f"cannot keep the answer: {type(exc).__name__}", retryable=True
            ) from None
