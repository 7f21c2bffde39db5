"""Escalating one request through the JetStream work queue, as the edge and the SDK do.

Order matters: subscribe to ``mesh.v1.tok.<scope>.<id>``, then publish on
``mesh.v1.infer.<model>.<scope>`` with ``Nats-Msg-Id = <scope>.<id>`` on the same connection and
wait for the publish ack: from then on the request is durable. NATS handles one connection's
commands in order, so the subscription is in place before the request can reach a worker; no
flush (a round trip) is needed in between. A publish JetStream reports as a
duplicate (the same id sent again within the duplicate window) is not queued twice; its sender
reads the answer from the answer store.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import secrets
import time
from collections.abc import Mapping

import msgpack
import nats.errors
import orjson
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

from mesh.answer_store import AnswerStore
from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.js_refused import CLUSTER_UNAVAILABLE, for_now, no_room, refused_for_good
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from mesh.queue_watch import QueueWatch, queue_watch
from mesh.reader import AnswerReader
from mesh.repair import store_repair
from mesh.tasks import cancel_and_wait
from protocol.codec import WireFormat, dump
from protocol.errors import (
    MeshError,
    MeshTimeoutError,
    PayloadTooLargeError,
    UnavailableError,
)
from protocol.fingerprint import Fingerprints, request_fingerprint
from protocol.messages import EndEvent, InferRequest, TokenEvent
from protocol.stream import AnswerState
from protocol.subjects import (
    cancel_subject,
    infer_subject,
    orphan_subject,
    token_subject,
    worker_alive_subject,
    worker_cancel_subject,
    worker_of,
)

log = get_logger(__name__)

MSG_ID_HEADER = "Nats-Msg-Id"
COPY_HEADER = "Mesh-Copy"
"""Marks a request queued again by its sender (:meth:`CloudCall.requeue`): a worker may hold
the original unseen, so one taking the copy numbers its attempt above the original's."""
ELECTION_RETRY_S = 2.0
"""A retry-after for that: nats-server's elections took 2 to 8 s in tests/chaos/test_cluster.py."""
ADDRESSED_CANCEL_WAIT_S = 0.5
"""How long a cancel addressed to the worker holding a request waits for its word before the
cancel goes to every worker (the holder died, or handed the request on)."""
WITHDRAW_DELETE_WAIT_S = 0.5
"""How long withdrawing a request waits for the queue to delete it (its cancel covers the rest)."""
WITHDRAW_S = ADDRESSED_CANCEL_WAIT_S + WITHDRAW_DELETE_WAIT_S
"""The longest a withdraw takes."""
REQUEUE_FIRST_S = 0.1
"""The first pause before a request whose queue was lost is queued again, when the queue
refuses it (not back yet); it doubles up to a second, each pause drawn within half of it."""
ALIVE_WAIT_S = 0.2
"""How long a reader waits for the worker generating its answer to say it is there. No word in
time proves nothing by itself (it may be busy): a live worker then asks again, for longer."""
ORPHAN_WAIT_S = 0.5
"""How long a reader waits for a live worker to hand a dead one's delivery back (its own check
takes 0.4 s at most) before it asks again. Workers claim each hand-back once (see
:mod:`cloud_node.orphans`), so asking again hands nothing back twice."""
ORPHAN_TRIES = 2


def new_cancel_key() -> str:
    return secrets.token_urlsafe(18)


def cancel_payload(key: str | None) -> bytes:
    """A cancel message: empty, or a msgpack map with the sender's key."""
    return bytes(msgpack.packb({"key": key})) if key else b""


def orphan_payload(node: str) -> bytes:
    """What a reader says on ``mesh.v1.orphan.<scope>.<id>``: the worker it found gone."""
    return json.dumps({"worker": node}).encode()


def reader_has(state: AnswerState) -> bytes:
    """What a reader says it has when it asks the worker generating its answer whether it is
    there: its attempt, its positions, and the first position it holds beyond a gap (see
    :func:`cloud_node.orphans.reader_has`). The worker publishes again what it lacks."""
    held = [
        e.seq
        for e in state.held
        if isinstance(e, (TokenEvent, EndEvent)) and e.attempt == state.attempt
    ]
    has: dict[str, int] = {"attempt": state.attempt, "seq": state.positions}
    if held:
        has["upto"] = min(held)
    return json.dumps(has).encode()


def orphan_worker(data: bytes) -> str | None:
    """The worker a reader's word names (a hint only: the store and the server decide)."""
    try:
        node = orjson.loads(data).get("worker") if data else None  # no recursion, if nested
    except (ValueError, AttributeError):
        return None
    return node if isinstance(node, str) and 0 < len(node) <= 256 else None


async def publish_request(
    conn: Connection,
    stream: StreamSettings,
    request: InferRequest,
    scope: str,
    extra_headers: Mapping[str, str] | None = None,
) -> api.PubAck:
    """Publish ``request`` to its model's queue subject under ``scope``; typed errors for every
    failure."""
    model = request.model
    if model is None:
        raise ValueError("request.model must be set before it is queued")
    subject = infer_subject(model, scope)
    # No Content-Type: a msgpack map's first byte says what it is (protocol.codec.sniff), and
    # each header is a parse for every worker that reads the request.
    headers = {**(extra_headers or {}), MSG_ID_HEADER: f"{scope}.{request.id}"}
    payload = dump(request, WireFormat.MSGPACK)
    try:
        with conn.refusals.until_refused(subject, request.id):  # refused: said at once
            return await conn.publish_acked(
                subject,
                payload,
                timeout=conn.settings.request_timeout,
                stream=stream.name,
                headers=headers,
            )
    except nats.errors.MaxPayloadError:
        raise request_too_large(len(payload), conn.nc.max_payload, request.id) from None
    except APIError as exc:
        if "header" in (exc.description or ""):  # "header size exceeds maximum allowed"
            raise PayloadTooLargeError(
                f"the request's headers are too large ({exc.description})", request_id=request.id
            ) from None
        full = no_room(exc, "the cloud queue", stream.retry_after, request.id)
        if full is not None:
            raise full from None
        if exc.err_code == CLUSTER_UNAVAILABLE:
            raise UnavailableError(
                "the hub's JetStream cannot take requests now: it is electing a leader or short "
                f"of quorum; retry in ~{ELECTION_RETRY_S:g}s",
                retry_after=ELECTION_RETRY_S,
                request_id=request.id,
            ) from None
        if for_now(exc):  # still storing the same id, or a 5xx: the request may go again
            raise UnavailableError(
                f"JetStream cannot take the request now ({exc.description})", request_id=request.id
            ) from None
        raise refused_for_good(exc, "JetStream refused the request", request.id) from None
    except NoStreamResponseError:
        limited = ", or these credentials may not queue there (ask through an edge)"
        raise UnavailableError(
            f"no JetStream stream took the request on {subject}: the hub may be electing a "
            f"leader (retry in ~{ELECTION_RETRY_S:g}s), or JetStream is not enabled or not "
            "provisioned there (`mesh provision`)"
            + (limited if conn.settings.least_privilege else ""),
            retry_after=ELECTION_RETRY_S,
            request_id=request.id,
        ) from None
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        conn.refusals.raise_if_refused(subject, request.id)  # not JetStream's: the sender's
        raise MeshTimeoutError(
            f"JetStream did not ack the request within {conn.settings.request_timeout:g}s",
            request_id=request.id,
        ) from None
    except (
        nats.errors.ConnectionClosedError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.ConnectionReconnectingError,
    ) as exc:
        raise UnavailableError(
            f"NATS is not connected ({type(exc).__name__})", request_id=request.id
        ) from None


def request_too_large(size: int, limit: int, request_id: str) -> PayloadTooLargeError:
    """A request the server will not carry: sent again, it never will (not retryable)."""
    return PayloadTooLargeError(
        f"the request is {size} bytes encoded, over the {limit} bytes one NATS message may "
        "carry here (the server's max_payload): shorten the prompt",
        request_id=request_id,
    )


class CloudCall(Lifecycle):
    """One queued request: ``async with CloudCall(...) as call:`` then ``call.reader`` reads its
    answer (repairing from the answer store), ``call.withdraw()`` takes it back."""

    def __init__(
        self,
        conn: Connection,
        stream: StreamSettings,
        request: InferRequest,
        *,
        scope: str,
        headers: Mapping[str, str] | None = None,
        pending_limit: int | None = None,
        fingerprints: Fingerprints | None = None,
    ) -> None:
        self.conn = conn
        self.headers = dict(headers or {})
        self.stream = stream
        # Queued without a reply subject, and under a cancel key: a copy only when it lacks
        # either (a caller that built its own copy, as an edge's relay does, is not copied twice).
        self.request = (
            request
            if request.reply is None and request.cancel_key
            else request.model_copy(
                update={"reply": None, "cancel_key": request.cancel_key or new_cancel_key()}
            )
        )
        self.scope = scope
        self.subject = token_subject(scope, self.request.id)
        # One serialization of a long conversation, where the caller has one already; worked
        # out when the answer's start comes, not before the request leaves.
        queued = self.request
        fingerprint = (
            fingerprints.lazily(queued.model)
            if fingerprints is not None
            else functools.partial(request_fingerprint, queued)
        )
        self.store = AnswerStore(conn, stream)
        self.ack: api.PubAck | None = None
        self.reader = AnswerReader(
            conn,
            AnswerState(queued.id, fingerprint=fingerprint),
            store_repair(self.store.replay, self.subject),
            what="the cloud",
            pending_limit=pending_limit,
            watch=self.watch_worker,
            resend=self.resend_missing,
        )
        self.lost_worker: str | None = None
        """The worker (node id) that started the newest attempt and is gone: the server said
        nobody subscribes to its subjects any more."""
        self.no_worker_left = False
        """Set when, the worker being gone, no live worker at all heard of it."""
        self.stalled_worker: str | None = None
        """The worker that said its engine stands still on this answer (no progress at all for
        its ``report_stall_after``): alive, but the answer will not go on there."""
        self.holding: tuple[str, float] | None = None
        """The worker that last told the watch it holds the request, and when
        (``time.monotonic()``): its own word on it, beside the registry's."""
        self._reported: set[tuple[str, int]] = set()
        self._watch: QueueWatch | None = None
        self._resent = False
        self._requeuing: asyncio.Task[None] | None = None
        self._queued_at = 0.0

    async def open(self) -> CloudCall:
        await self.reader.subscribe(self.subject)
        try:
            self.ack = await publish_request(
                self.conn, self.stream, self.request, self.scope, self.headers
            )
        except BaseException:
            await self.close()
            raise
        if self.ack.duplicate:
            # Queued before under this id: its answer may be complete already. Catch up now.
            log.info("request already queued (duplicate publish)", request_id=self.request.id)
            self.reader.repair_now()
            # The first copy's window is not ours to know: a copy sent again later could land
            # past it, a second one in the queue. Its own sender queues it again if need be.
            self._resent = True
        self._queued_at = time.monotonic()
        self._watch = queue_watch(self.conn, self.stream)
        self._watch.add(self)  # its queue lost under it: queued again (mesh.queue_watch)
        return self

    @property
    def model(self) -> str:
        return self.request.model or ""

    @property
    def queued_at(self) -> float:
        return self._queued_at

    @property
    def started(self) -> bool:
        return self.reader.state.started

    def requeue(self) -> None:
        """The queue may have lost the request (:mod:`mesh.queue_watch`): queue it again, under
        its message id, within the queue's duplicate window of its first publish. A queue that
        still holds it (or took it and answered it) drops the copy, and one made anew takes it.
        Past the window a copy could not be told from the first, and is not sent."""
        if self._watch is None or self.started or self._resent:
            return  # withdrawn or closed, a worker has it, or not its own copy (below)
        self.ack = None  # its sequence may be another request's in a queue made anew
        if self._requeuing is None or self._requeuing.done():
            self._requeuing = asyncio.get_running_loop().create_task(self._requeue())

    async def _requeue(self) -> None:
        pause = REQUEUE_FIRST_S
        copy_headers = {**self.headers, COPY_HEADER: "1"}  # a worker may hold the original
        while not self.started and self._within_window():
            try:
                ack = await publish_request(
                    self.conn, self.stream, self.request, self.scope, copy_headers
                )
            except RuntimeError:
                return  # the connection is closed: the call ends with it
            except MeshError:  # the queue is not back yet (its worker puts it back), or full
                await asyncio.sleep(pause * random.uniform(0.5, 1.5))  # noqa: S311 - spread, not secret
                pause = min(pause * 2, 1.0)
                continue
            self.ack = ack  # the copy the queue holds (a duplicate's ack names the one it had)
            if not ack.duplicate:
                log.warning("queue had lost the request; queued again", request_id=self.request.id)
            return

    def _within_window(self) -> bool:
        """Whether the queue would still drop a copy of the request as a duplicate (a margin
        of a request timeout short of its window, for the copy's way there)."""
        margin = self.conn.settings.request_timeout
        return time.monotonic() - self._queued_at < self.stream.duplicate_window - margin

    async def watch_worker(self, state: AnswerState) -> None:
        """The answer went quiet: ask the worker that started it whether it is still there.
        When the server says nobody listens there (its process died, its connection is gone),
        or it says nothing in time (it stands still), say so to the live workers: one of them
        checks for itself and hands the delivery back to the queue at once (see
        :mod:`cloud_node.orphans`), and the answer goes on from the store within a second
        rather than after ``ack_wait``."""
        node = worker_of(state.node)
        if node is None:
            return
        nc = self.conn.nc
        try:
            word = await self._ask_alive(node, state)
        except nats.errors.NoRespondersError:
            if not await self.conn.hub_answers(ALIVE_WAIT_S):
                return  # the site's uplink is down: nothing proven
            gone = True
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            gone = False  # standing still, or merely busy: a live worker tells them apart
        except nats.errors.Error:
            return  # our own link is down: nothing proven
        else:
            self._answered(node, word)
            return
        if gone and self.lost_worker != node:
            self.lost_worker = node
            log.warning("the worker answering is gone", worker=node, request_id=self.request.id)
        if (node, state.attempt) in self._reported:
            return  # the live workers heard of it already
        reply = None
        for _try in range(ORPHAN_TRIES):
            try:
                reply = await nc.request(
                    orphan_subject(self.scope, self.request.id),
                    orphan_payload(node),
                    timeout=ORPHAN_WAIT_S,
                )
                break
            except nats.errors.NoRespondersError:
                if gone and await self.conn.hub_answers(ALIVE_WAIT_S):
                    self.no_worker_left = True
                    self._reported.add((node, state.attempt))
                    log.warning(
                        "no live worker can continue the answer", request_id=self.request.id
                    )
                return
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                continue
            except nats.errors.Error:
                return
        if reply is None:
            return  # ack_wait still hands it on
        verdict = ""
        with contextlib.suppress(ValueError, AttributeError):
            verdict = str(json.loads(reply.data).get("verdict", ""))
        if gone or verdict.startswith("handed back"):
            self._reported.add((node, state.attempt))  # once per attempt
        log.info("takeover asked", worker=node, verdict=verdict, request_id=self.request.id)

    def _answered(self, node: str, word: Msg) -> None:
        """Worker ``node`` answered the watch: whatever was said of it before (gone: its link
        dropped and came back; standing still: its engine moved again) holds no longer."""
        said: dict[str, object] = {}
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            said = dict(json.loads(word.data))
        stalled = bool(said.get("stalled"))
        if said.get("held"):
            self.holding = (node, time.monotonic())
        if stalled:
            self.stalled_worker = node
        elif self.stalled_worker == node:
            self.stalled_worker = None
        if self.lost_worker == node:
            self.lost_worker, self.no_worker_left = None, False

    def held_by(self, node: str, within: float) -> bool:
        """Whether worker ``node`` told the watch, within the last ``within`` seconds, that it
        holds the request."""
        return (
            self.holding is not None
            and self.holding[0] == node
            and time.monotonic() - self.holding[1] < within
        )

    async def resend_missing(self, state: AnswerState) -> None:
        """A repair left a gap: the answer store does not hold the missing events (they went out
        as its leader died, and until it has a new one it stores nothing). Ask the worker
        generating the answer, which still has them, to publish them again; they arrive on the
        reader's subscription. A worker that does not answer in time costs ALIVE_WAIT_S: the
        reader's next repair asks again."""
        node = worker_of(state.node)
        if node is None:
            return
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await self._ask_alive(node, state)

    async def _ask_alive(self, node: str, state: AnswerState) -> Msg:
        """Ask worker ``node`` whether it still holds this answer, saying what the reader has:
        a live worker sends again what the reader lacks of it."""
        return await self.conn.nc.request(
            worker_alive_subject(node, self.scope, self.request.id),
            reader_has(state),
            timeout=ALIVE_WAIT_S,
        )

    async def withdraw(self) -> None:
        """Take the request back: delete it from the queue if still there, and cancel it."""
        await self._no_requeue()  # a reconnect meanwhile must not queue it again
        payload = cancel_payload(self.request.cancel_key)
        node = worker_of(self.reader.state.node)  # who started it (if a start event came)
        held = node is not None and await self._cancel_at(node, payload)
        if not held:  # queued, or its worker is gone or let it go: whoever takes it next must know
            with contextlib.suppress(Exception):
                await self.conn.nc.publish(cancel_subject(self.scope, self.request.id), payload)
        deletable = not self.conn.settings.least_privilege  # else its cancel alone takes it back
        if self.ack is not None and not self._resent and deletable:
            # Fails when already delivered (the cancel covers that) or already gone: both fine.
            # Bounded: a stream without a leader (an election) would hold the caller, who is
            # about to answer another way, for the whole API timeout; the cancel covers it.
            with contextlib.suppress(APIError, asyncio.TimeoutError, nats.errors.Error):
                delete = self.conn.jsm().delete_msg(self.ack.stream, self.ack.seq)
                await asyncio.wait_for(delete, WITHDRAW_DELETE_WAIT_S)

    async def _cancel_at(self, node: str, payload: bytes) -> bool:
        """Cancel at the worker the start event named; True when it held the request (then
        nobody else needs to hear of it)."""
        try:
            reply = await self.conn.nc.request(
                worker_cancel_subject(node, self.scope, self.request.id),
                payload,
                timeout=ADDRESSED_CANCEL_WAIT_S,
            )
            return bool(json.loads(reply.data).get("held"))
        except (nats.errors.Error, asyncio.TimeoutError, ValueError, AttributeError):
            return False  # no such worker now (it died), or it did not answer in time

    async def _no_requeue(self) -> None:
        if self._watch is not None:
            self._watch.discard(self)
            self._watch = None
        if self._requeuing is not None:
            await cancel_and_wait([self._requeuing])

    async def close(self) -> None:
        await self._no_requeue()
        await self.reader.close()

    start = open
    stop = close
