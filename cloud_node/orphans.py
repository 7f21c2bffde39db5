"""A dead or frozen worker's deliveries, handed back at once instead of after ``ack_wait``.

When a worker's process dies (kill -9, an OOM kill, a lost host), the server closes its
connection at once and forgets its subscriptions, but JetStream redelivers its requests only
when their ``ack_wait`` runs out (5 s). The answer's reader notices first: after a quiet spell
(0.25 s) it asks the worker that started the answer whether it is there
(``mesh.v1.worker.<node>.alive.<scope>.<id>``). A dead worker has no subscription, so the server
itself answers "no responders" within a round trip; a frozen one (SIGSTOP, a stalled loop) says
nothing. The reader then says so on ``mesh.v1.orphan.<scope>.<id>``, naming the worker. Every
live worker hears it (a queue group could pick the very worker that stands still), and:

1. asks the named worker itself (one question per worker at a time, shared by its requests):
   one that answers within ``ALIVE_WAIT_S`` keeps its deliveries;
2. reads the answer's newest ``start`` from the answer store (written by a worker, not the
   reader): which worker holds the request, and the delivery (its ack subject) it holds, and
   asks that one if it is another;
3. checks that the delivery is this queue's and that the queued message under it is this very
   request of this scope (a forged ``start`` cannot make it hand back another's request), and
   that it is not the last delivery (``max_deliver``: JetStream would give it to nobody);
4. claims the hand-back of that attempt, once across all workers (an atomic create in the
   registry bucket, expiring with its TTL), and naks the delivery: JetStream gives the request
   to a worker with room at once, which continues the answer from the store as after any
   redelivery.

A worker taken for gone or frozen that was neither (its link dropped and came back, its loop
stood still 0.4 s) knows it: it counts its connection's drops and its own stand-stills from
0.3 s (:class:`cloud_node.progress.LoopStalls`), and after either it checks the store for a
newer attempt before it settles anything, and stops generating once it sees one. No reply at all
means no worker is alive: the reader knows that too (an edge then answers locally).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from cloud_node.delivery import delivery_of
from mesh.answer_store import AnswerStore
from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.queue import orphan_worker
from mesh.registry import create_once, handback_key, open_bucket
from mesh.tasks import cancel_and_wait
from protocol.codec import RequestLimits, decode_request
from protocol.errors import MeshError
from protocol.messages import EndEvent, ErrorEvent, StartEvent, WireEvent, queued_request_id
from protocol.subjects import (
    ORPHAN_WILDCARD,
    addressed,
    is_reply_inbox,
    scope_of,
    token_subject,
    worker_alive_subject,
    worker_alives,
    worker_of,
)

log = get_logger(__name__)

ALIVE_WAIT_S = 0.4
"""How long a worker waits for another's word before taking it for standing still. A worker
counts its own stand-stills from 0.3 s (:class:`cloud_node.progress.LoopStalls`), so one that
was taken for standing still knows it, and checks the answer store before it settles."""
REMEMBER_S = 60.0
"""How long a handed-back delivery is remembered (a second word about it changes nothing)."""
MAX_AT_ONCE = 256
"""Words about dead workers handled at once; past it they wait for ack_wait like before."""
VERDICT_TTL_S = 0.5
"""How long one answer about a worker (alive, gone, standing still) stands for its requests."""
UNSTARTED_GRACE_S = 1.0
"""How long a delivery stays without a start (two looks this far apart) before a worker whose
link came back hands it back (:meth:`Orphans.hand_back_unstarted`): a live worker on a sound
link writes a delivery's start within milliseconds."""
UNSTARTED_MAX = 64
"""Queued messages looked at in one look, the oldest unacked first."""
FIRST_PAGE = 1024
"""The bytes of an answer's first stored events read to tell whether it has any (one larger
is there too: the read says it does not fit)."""


def newest_start(events: list[WireEvent]) -> tuple[StartEvent | None, bool]:
    """The newest attempt's start in stored events, and whether the answer has an outcome."""
    start: StartEvent | None = None
    done = False
    for event in events:
        if isinstance(event, StartEvent) and (start is None or event.attempt >= start.attempt):
            start = event
        elif isinstance(event, (EndEvent, ErrorEvent)):
            done = True
    return start, done


def reader_has(data: bytes) -> tuple[int, int, int | None] | None:
    """What a reader's "are you there?" says it has of the answer: (attempt, positions, the
    first position it holds beyond a gap or None); None when it says nothing (an empty word, or
    an older reader)."""
    if not data:
        return None
    try:
        has = orjson.loads(data)  # a client's word: no recursion however it nests
        attempt, seq, upto = has["attempt"], has["seq"], has.get("upto")
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    fields = (attempt, seq) if upto is None else (attempt, seq, upto)
    if not all(isinstance(f, int) and not isinstance(f, bool) and f >= 0 for f in fields):
        return None
    return attempt, seq, upto


class Orphans:
    """Answers "are you there?" for this worker, and hands back dead workers' deliveries."""

    def __init__(
        self,
        conn: Connection,
        store: AnswerStore,
        stream: StreamSettings,
        *,
        node_id: str,
        alive: Callable[[str], dict[str, bool]],
        request_limits: RequestLimits,
        resend: Callable[[str, int, int, int | None], Awaitable[int]] | None = None,
    ) -> None:
        self.conn = conn
        self.store = store
        self.stream = stream
        self.node_id = node_id
        self.alive = alive
        """What this worker says of the request on a token subject: whether it holds it, and
        whether its engine stands still on it."""
        self.resend = resend
        """Publishes again what a reader lacks of an answer this worker sent (see
        :meth:`cloud_node.serve.Handler.resend`); the word may say what it has."""
        self._limits = request_limits
        self._handed: dict[tuple[str, int], float] = {}
        self._busy: set[asyncio.Task[None]] = set()
        self._asking: dict[str, asyncio.Future[str]] = {}
        self._verdicts: dict[str, tuple[str, float]] = {}
        self._kv: KeyValue | None = None
        self.handed_back = 0
        self.handed_back_silent = 0
        """Of those, deliveries of workers that stood still (not gone): each may have been a
        live worker's, taken over (a cost its client sees as a continuation)."""

    async def subscribe(self) -> list[Subscription]:
        nc = self.conn.nc
        return [
            await nc.subscribe(worker_alives(self.node_id), cb=self._on_alive),
            # Every live worker hears it (no queue group: one picked at random could be the
            # very worker that stands still); their claims make one of them act.
            await nc.subscribe(ORPHAN_WILDCARD, cb=self._on_orphan),
        ]

    async def _on_alive(self, msg: Msg) -> None:
        address = addressed(msg.subject)
        if address is None or not (msg.reply and is_reply_inbox(msg.reply)):
            return
        scope, request_id = address
        subject = token_subject(scope, request_id)
        word: dict[str, Any] = dict(self.alive(subject))
        has = reader_has(msg.data)
        if has is not None and self.resend is not None:
            word["resent"] = await self.resend(subject, *has)
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(json.dumps(word).encode())

    async def _on_orphan(self, msg: Msg) -> None:
        """Each word in a task of its own: a worker that stood still holds many answers, and
        their readers speak at once (one after another, the last waited ALIVE_WAIT_S each)."""
        if len(self._busy) >= MAX_AT_ONCE:
            return  # a flood: ack_wait still hands every delivery on
        task = asyncio.get_running_loop().create_task(self._answer(msg), name="orphan")
        self._busy.add(task)
        task.add_done_callback(self._busy.discard)

    async def _answer(self, msg: Msg) -> None:
        address = addressed(msg.subject)
        if address is None:
            return
        scope, request_id = address
        named = orphan_worker(msg.data)
        try:
            if named is not None and named != self.node_id:
                # The reader's word names the worker: a cheap first look (one question per
                # worker, shared), before anything is read for this request.
                subject = worker_alive_subject(named, scope, request_id)
                if await self._probe(named, subject) == "alive":
                    return  # nothing to do, and no word: another worker may know better
            verdict = await self.hand_back(scope, request_id)
        except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
            verdict = f"cannot tell now ({type(exc).__name__})"
        log.info("told a worker is gone", request_id=request_id, scope=scope, verdict=verdict)
        # Replies go to an ordinary inbox only (see the worker's cancels).
        if msg.reply and is_reply_inbox(msg.reply):
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(json.dumps({"verdict": verdict}).encode())

    async def hand_back(self, scope: str, request_id: str) -> str:
        """Hand back the delivery of the worker that started this answer, if it is dead; what
        was found, in a few words (``handed back`` when it was)."""
        address = token_subject(scope, request_id)
        events = await self.store.replay(address, timeout=self.conn.settings.request_timeout)
        start, done = newest_start(events)
        if start is None or done:
            return "done" if done else "not started"
        node = worker_of(start.node)
        if node is None or not start.delivery:
            return "not a worker's delivery"
        if node == self.node_id:
            return "alive"  # this very worker: it holds it, or it let it go already
        key = (address, start.attempt)
        self._forget_old()
        if key in self._handed:
            return "handed back already"
        found = delivery_of(start.delivery)
        if found is None or found[0] != self.stream.name:
            return "not this queue's delivery"
        _stream, delivered, sseq = found
        if delivered >= self.stream.max_deliver:
            return "last delivery: left to JetStream"
        why = await self._probe(node, worker_alive_subject(node, scope, request_id))
        if why == "alive":
            return why
        if not await self._queued_as(sseq, scope, request_id):
            return "not this request's delivery"
        claim = await self._claim(scope, request_id, start.attempt)
        if claim is None:
            return "cannot claim the hand-back now: left to ack_wait"
        self._handed[key] = time.monotonic()
        if not claim:
            return "handed back already"
        await self.conn.nc.publish(start.delivery, b"-NAK")
        self.handed_back += 1
        if why != "gone":
            self.handed_back_silent += 1
        log.warning(
            "handed back a dead worker's delivery",
            why=why,
            request_id=request_id,
            worker=node,
            attempt=start.attempt,
            delivered=delivered,
        )
        return "handed back"

    async def _probe(self, node: str, subject: str) -> str:
        """``alive``, ``gone`` (no responders) or ``standing still`` (no word in time). One
        question per worker at a time, its answer shared by every request asked about and kept
        VERDICT_TTL_S: a worker holding 32 answers is asked once, not 32 times."""
        now = time.monotonic()
        known = self._verdicts.get(node)
        if known is not None and now - known[1] < VERDICT_TTL_S:
            return known[0]
        asking = self._asking.get(node)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(subject))
            self._asking[node] = asking
        try:
            why = await asyncio.shield(asking)
        finally:
            if asking.done() and self._asking.get(node) is asking:
                del self._asking[node]
        now = time.monotonic()
        if len(self._verdicts) >= MAX_AT_ONCE:  # words naming many workers: keep the fresh
            self._verdicts = {n: v for n, v in self._verdicts.items() if now - v[1] < VERDICT_TTL_S}
        self._verdicts[node] = (why, now)
        return why

    async def _ask(self, subject: str) -> str:
        try:
            await self.conn.nc.request(subject, b"", timeout=ALIVE_WAIT_S)
        except nats.errors.NoRespondersError:
            return "gone"
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return "standing still"
        return "alive"

    async def close(self) -> None:
        await cancel_and_wait([*self._busy, *self._asking.values()])

    async def _claim(self, scope: str, request_id: str, attempt: int) -> bool | None:
        """Claim the hand-back of this attempt's delivery, once across every worker: a key
        created in the registry bucket (an atomic create; it expires with the bucket's TTL).
        Two workers that each heard of one death must not both nak: the second nak would
        name the message again after it was given to its next worker, and take it from
        under that one. False when another claimed it, None when no claim can be made now (a
        later word may try again)."""
        try:
            if self._kv is None:
                self._kv = await open_bucket(self.conn, self.stream.node_ttl)
            await asyncio.wait_for(
                create_once(self._kv, handback_key(scope, request_id, attempt)),
                self.conn.settings.request_timeout,
            )
        except KeyWrongLastSequenceError:
            return False
        except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("cannot claim the hand-back now", error=repr(exc))
            self._kv = None
            return None
        return True

    async def _queued_as(self, sseq: int, scope: str, request_id: str) -> bool:
        """Whether the queue's message ``sseq`` is request ``request_id`` of ``scope``."""
        try:
            stored = await self.conn.jsm().get_msg(self.stream.name, sseq)
        except (APIError, asyncio.TimeoutError, nats.errors.Error):
            return False  # gone: acked, deleted, or not there
        return self._queued(stored, sseq) == (scope, request_id)

    def _queued(self, stored: RawStreamMsg, sseq: int) -> tuple[str, str] | None:
        """The scope and id of the request in the queue's message ``stored`` (None: not one)."""
        scope = None if stored.subject is None else scope_of(stored.subject)
        if scope is None or stored.data is None:
            return None
        try:
            request, _fmt = decode_request(
                stored.data,
                stored.headers,
                limits=self._limits,
                missing_id=queued_request_id(sseq),
            )
        except MeshError:
            return None
        return scope, request.id

    async def hand_back_unstarted(self, consumer: str, last: str = "") -> int:
        """After this worker's link dropped and came back, hand back the deliveries nobody
        started; the number handed back. A delivery on its way as the link went is lost with
        it, and JetStream counts it delivered: it comes again only after ``ack_wait``, and no
        start names it for :meth:`hand_back`. Two looks :data:`UNSTARTED_GRACE_S` apart at the
        consumer's unacked messages: one with nothing in the answer store at both (no start, no
        outcome) is claimed once across workers, as :meth:`hand_back` claims, and naked by its
        stream sequence (JetStream's nak asks only that the delivery sequence it names lies
        past the consumer's ack floor). A worker standing still on a delivery it had not
        started is taken over so too, as after ``ack_wait``, and knows it when it wakes.

        A delivery on its way to another worker over a link slower than the grace looks lost
        too, and is taken over: generated twice, its client still gets one answer (readers
        follow the newer attempt; the older stops when it sees it). Never on a queue that
        delivers once (``max_deliver`` 1), where the nak would end the request. A message with
        nothing stored was delivered once (an earlier attempt writes its start): with two
        deliveries or more, the one handed back is never the last.

        ``last``: the ack subject of the last delivery this worker got before the link went;
        only messages queued after it are looked at (a fleet's workers back from a server's
        restart look at their own few, not at every answer in flight)."""
        if not self.store.enabled or self.stream.max_deliver < 2:
            return 0  # no starts to tell a held delivery from a lost one; or the last one
        found = delivery_of(last)
        after = found[2] if found is not None and found[0] == self.stream.name else 0
        first, _ = await self._unstarted(consumer, after)
        if not first:
            return 0
        await asyncio.sleep(UNSTARTED_GRACE_S)
        second, delivered = await self._unstarted(consumer, after)
        handed = 0
        for sseq, queued in second.items():
            if first.get(sseq) != queued or not await self._claim(*queued, 0):
                continue
            ack = f"$JS.ACK.{self.stream.name}.{consumer}.1.{sseq}.{delivered}.0.0"
            with contextlib.suppress(nats.errors.Error):
                await self.conn.nc.publish(ack, b"-NAK")
                handed += 1
                log.warning("handed back a delivery lost with the link", request_id=queued[1])
        self.handed_back += handed
        return handed

    async def _unstarted(self, consumer: str, after: int) -> tuple[dict[int, tuple[str, str]], int]:
        """The consumer's unacked messages past stream sequence ``after`` with nothing stored
        of their answers (stream sequence: scope and id), and its last delivery's sequence."""
        found: dict[int, tuple[str, str]] = {}
        timeout = self.conn.settings.request_timeout
        try:
            info = await self.conn.jsm().consumer_info(self.stream.name, consumer, timeout=timeout)
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            log.debug("unstarted deliveries not looked at", error=repr(exc))
            return found, 0
        if not info.num_ack_pending or info.delivered is None or info.ack_floor is None:
            return found, 0
        last, seq = info.delivered.stream_seq, max(info.ack_floor.stream_seq, after) + 1
        config = info.config
        only = config.filter_subject or (config.filter_subjects or [None])[0]
        for _ in range(UNSTARTED_MAX):
            try:
                stored = await self.conn.jsm().get_msg(self.stream.name, seq, only, next=True)
            except (APIError, asyncio.TimeoutError, nats.errors.Error):
                break  # none left (acked ones are gone from a work queue), or no answer
            if stored.seq is None or stored.seq > last:
                break
            queued = self._queued(stored, stored.seq)
            seq = stored.seq + 1
            if queued is None:
                continue
            try:
                page = await self.store.read_page(token_subject(*queued), 0, FIRST_PAGE, timeout)
            except (MeshError, nats.errors.Error, asyncio.TimeoutError):
                continue  # an event too large for the page, or no answer: not proven lost
            if not page.events:
                found[stored.seq] = queued
        return found, info.delivered.consumer_seq

    def _forget_old(self) -> None:
        horizon = time.monotonic() - REMEMBER_S
        for key, at in list(self._handed.items()):
            if at < horizon:
                del self._handed[key]
