"""An edge site's links to the hub: the forwarder and the collector (see :mod:`edge_node.site`).

The *forwarder* takes the site's outbox one held request at a time, in order, and publishes each
to the hub's work queue through the leaf link; only after the hub's ack does it ack the outbox
copy, and while the uplink is down it keeps the request and tries again. A request the hub
refuses for good is answered with a typed error kept at the site. The *collector* reads the
site's answers through a durable hub consumer filtered to its own scope, writes each into the
site's ``MESH_KEPT`` and only then acks it on the hub. A flap at any point means a retry, never
a loss or a second copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

from edge_node.consumer_look import until_there
from edge_node.lanes import lane_secret
from edge_node.served import CloudModels
from mesh import kept
from mesh.config import EdgeSettings, StreamSettings
from mesh.connection import Connection
from mesh.js_refused import for_now, refused_for_good
from mesh.logs import get_logger
from mesh.pull import Pull, PullLost, hand_back
from mesh.queue import MSG_ID_HEADER
from mesh.tasks import TaskSet, raise_if_cancelled
from protocol.codec import WireFormat, dump, error_event, load, sniff
from protocol.errors import DeadlineExceededError, MeshError, UnavailableError
from protocol.subjects import (
    ANSWERS_STREAM,
    KEPT_STREAM,
    OUTBOX_STREAM,
    infer_subject,
    kept_subject,
    site_consumer,
)

log = get_logger(__name__)
T = TypeVar("T")
FORWARDER = "forwarder"
RETRY_S = 1.0
"""Pause between tries while the uplink is down."""
FORWARD_RETRY_S = 0.25
"""Pause between a held request's tries to reach the hub: each is a publish to the site's own
leaf, refused at once while the uplink is down, so trying often costs little, and the request
leaves within a quarter second of the link's return (within a second at :data:`RETRY_S`)."""
BUSY_MAX_S = 8.0
"""The longest pause between a held request's tries while the hub answers but cannot take it
(its queue full) or answers too late: from :data:`RETRY_S`, doubling. Every site tried four
times a second, its whole request each time, at a hub already overloaded."""
KEEP_ERROR_TRIES = 5
"""Tries, a :data:`RETRY_S` apart, at keeping the error a held request ended in at the edge
(its deadline); past them the forwarder still refuses it when it comes to it."""
FORWARD_PULL_S = 5.0
"""How long one pull of the forwarder waits for a held request, on the site's own leaf."""
COLLECT_PULL_S = 1.0
"""The same for the collector, whose pulls go to the hub. Short: a pull sent before the edge's
link to its leaf dropped waits at the hub until it expires (its requester gone behind the leaf,
under accounts), and answers delivered to it meanwhile are lost until the site's loop has them
sent again (:meth:`mesh.pull.Pull.redeliver`), which it does once no such pull waits."""
PULL_HEARTBEAT_S = 0.5
"""JetStream's idle heartbeat on each pull: two missed, or no status by the pull's expiry, and
the pull is taken for lost (a hub restarted under the site's leaf node, or an uplink cut, drops
it without a word), so the loop looks for its consumer and pulls again within about 1.25 s
(:mod:`mesh.pull`)."""
FORWARD_ACK_S = 1.0
"""How long the forwarder waits for its leaf to confirm the ack of a forwarded request. Local,
so quick; an ack the leaf ignores (another edge of the site reset the consumer, see
:meth:`mesh.pull.Pull.redeliver`) costs this, not the request timeout, before the next one
goes (the request comes again and is forwarded again, dropped by the hub as a duplicate)."""
FIRST_LOOK_S = 0.1
"""The first pause between looks for a consumer not there; it doubles up to :data:`RETRY_S`."""
SITE_STREAMS = "site streams"
"""The edge connection's recovery step that puts back the site's streams and the forwarder."""
STREAMS_BACK_S = 1.0
"""How long a site operation that found one of the site's streams gone waits for the "site
streams" step to put them back before it tries once more."""
STREAM_GONE = (nats.errors.NoRespondersError, NoStreamResponseError)
"""What a read or a write of a site stream gets when the stream is not there (an operator's
``nats stream rm``, a leaf restarted on an empty store)."""
LINK_DOWN = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)
"""The edge's own link to its leaf is down: a forward is refused here, at no cost to anyone."""
OUTBOX_ACK_WAIT_S = 30.0
HELD_ID_HEADER = "Mesh-Id"
"""A held request's id (its outbox message id also carries its fingerprint)."""


@dataclass(frozen=True)
class SiteParts:
    """What the site uses of the edge."""

    conn: Connection
    edge_id: str
    scope: str
    creds_file: str | None
    """The site's credentials (a secret of its own is drawn from them)."""
    edge: EdgeSettings
    stream: StreamSettings
    models: CloudModels
    """Whether a worker pool serves a model."""


class SiteLinks:
    """The forwarder and the collector, each a supervised loop that retries until it is back."""

    def __init__(self, parts: SiteParts) -> None:
        self.parts = parts
        self.conn = parts.conn
        self.scope = parts.scope
        self._tasks = TaskSet("edge-site")
        self._pulls: dict[str, Pull] = {}
        """Each loop's pull, by loop (one restarted lets its old one go)."""
        self.forwarded = 0
        self.collected = 0
        self.forward_order: deque[str] = deque(maxlen=1000)
        """Ids of the latest forwarded requests, in the order they reached the hub."""
        self._lane_secret = lane_secret(parts.creds_file)
        self._reached_hub = asyncio.Event()
        """Set (and replaced by a fresh one) when a forward reached the hub: the uplink works,
        so a loop looking for its consumer there looks again now (the collector after an
        uplink cut)."""

    async def ensure_forwarder(self) -> None:
        """The outbox's forwarder consumer (idempotent; the outbox exists)."""
        try:
            await self.conn.site_jsm().add_consumer(
                OUTBOX_STREAM,
                api.ConsumerConfig(
                    durable_name=FORWARDER,
                    ack_policy=api.AckPolicy.EXPLICIT,
                    ack_wait=OUTBOX_ACK_WAIT_S,
                    max_ack_pending=1,  # one at a time: forwarded in the order held
                    max_deliver=-1,
                ),
            )
        except (APIError, asyncio.TimeoutError) as exc:
            raise UnavailableError(f"the site cannot hold requests: {exc!r}") from None

    async def start(self) -> None:
        """Both loops (the streams and the forwarder consumer exist already)."""
        self._tasks.supervise(self._forward_loop, name="site-forward")
        self._tasks.supervise(self._collect_loop, name="site-collect")

    async def stop(self) -> None:
        await self._tasks.close()
        for loop in list(self._pulls):  # else the connection's drain waits on them
            await self._unbind(loop)

    async def _unbind(self, loop: str) -> None:
        pull = self._pulls.pop(loop, None)
        if pull is not None:
            await pull.stop()

    # -- both loops ---------------------------------------------------------------------------
    async def _pulled(
        self,
        loop: str,
        consumer: tuple[Any, str, str, str],
        pull_s: float,
        handle: Callable[[Msg], Awaitable[None]],
        batch: int,
    ) -> None:
        """Pull ``consumer`` (its manager, API prefix, stream and name) and hand each message to
        ``handle``, for good; a pull lost (the consumer gone, its heartbeats stopped) waits until
        the consumer is there again."""
        jsm, prefix, stream, name = consumer
        await self._unbind(loop)  # a restarted loop's old subscription
        pull = Pull(self.conn, stream, name, prefix=prefix, heartbeat=PULL_HEARTBEAT_S)
        _, pull.rtt = await self._until_there(jsm, stream, name)
        self._pulls[loop] = pull
        await pull.start()
        pause = FIRST_LOOK_S
        while True:
            raise_if_cancelled()  # one a wait_for swallowed (Python 3.11)
            await pull.redeliver()  # deliveries a link took with it: now, not in 30 s
            try:
                msgs = await pull.fetch(batch, pull_s)
            except PullLost as exc:
                log.info("pull lost; looking for its consumer", loop=loop, why=str(exc))
                if loop == "forward":  # the site's own: put back by the edge
                    self.conn.recovery.again(SITE_STREAMS, f"the outbox's forwarder: {exc}")
                there, pull.rtt = await self._until_there(jsm, stream, name, pull.rtt)
                if there:  # there all along: the server refuses the pulls themselves
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, RETRY_S)
                continue
            except nats.errors.Error as exc:  # the link is down: the pull cannot be sent
                log.debug("pull not sent", loop=loop, error=repr(exc))
                await asyncio.sleep(RETRY_S)
                continue
            pause = FIRST_LOOK_S
            try:
                raise_if_cancelled()  # a cancel the fetch's wait swallowed (Python 3.11)
            except asyncio.CancelledError:
                await hand_back(msgs)  # to the next pull, not after ack wait
                raise
            for i, msg in enumerate(msgs):
                try:
                    await handle(msg)  # hands its own back when cancelled
                except BaseException:  # stopping, or a fault (the loop starts again)
                    await hand_back(msgs[i + 1 :])
                    raise

    async def _until_there(
        self, jsm: Any, stream: str, name: str, rtt: float = 0.0
    ) -> tuple[bool, float]:
        """Until ``stream`` has consumer ``name`` (the site's forwarder, made again by the
        edge; the site's consumer of answers, by a worker at each answer it keeps for it):
        whether it was there at the first look, and the seconds the look that found it took
        (a round trip to its server). Looks lost in a silent uplink are not waited out
        (:mod:`edge_node.consumer_look`; ``rtt``: the last look's)."""
        return await until_there(
            lambda: jsm.consumer_info(stream, name),
            name,
            rtt=rtt,
            timeout=self.conn.settings.request_timeout,
            reached=lambda: self._reached_hub,
            most_pause=RETRY_S,
        )

    # -- forwarder -----------------------------------------------------------------------------
    async def _forward_loop(self) -> None:
        outbox = (self.conn.site_jsm(), api.DEFAULT_PREFIX, OUTBOX_STREAM, FORWARDER)
        await self._pulled("forward", outbox, FORWARD_PULL_S, self._forward_held, 1)

    async def _forward_held(self, msg: Msg) -> None:
        try:
            await self._forward(msg)
        except asyncio.CancelledError:
            await hand_back([msg])  # stopping: the next forwarder need not wait ack_wait
            raise

    def _queue_id(self, scope: str, request_id: str) -> str:
        """The held request's message id in the hub's queue: ``<scope>.<id>``, so that a
        repeat of its forward (or the same id held again, whatever its content) is dropped
        there, then a tag only this site can make. JetStream drops a publish whose id it has
        seen, whoever sent it, and a sender may put any id on a message in its own lane: with
        ``<scope>.<id>`` alone, another site knowing an id could keep this site's request out
        of the queue. The tag comes from the site's credentials (none on an open server, where
        nothing keeps senders apart anyway)."""
        if self._lane_secret is None:
            return f"{scope}.{request_id}"
        tag = hmac.new(self._lane_secret, request_id.encode(), hashlib.sha256).hexdigest()
        return f"{scope}.{request_id}.{tag[:16]}"

    async def _forward(self, msg: Msg) -> None:
        """Publish one held request to the hub's queue, retrying until the hub acks it; then
        let the outbox copy go."""
        model, scope = _outbox_parts(msg.subject)
        if scope != self.scope:  # anyone on the leaf may publish here; the hub never takes it
            log.warning("dropping a held message of another scope", subject=msg.subject[:200])
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await msg.ack_sync(timeout=FORWARD_ACK_S)
            return  # else every request held after it waited behind it, for good
        if await self._ended(msg):  # answered already, or past its deadline, while held
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await msg.ack_sync(timeout=FORWARD_ACK_S)
            log.info("held request has its outcome kept; not sent", request_id=_held_id(msg))
            return
        deadline = _deadline_of(msg)
        headers = {
            k: v for k, v in (msg.headers or {}).items() if k not in (MSG_ID_HEADER, HELD_ID_HEADER)
        }
        headers[MSG_ID_HEADER] = self._queue_id(scope, _held_id(msg))
        last_progress = time.monotonic()
        busy = 0.0  # the pause while the hub answers "not now", doubling
        while True:
            if deadline is not None and time.time() >= deadline:  # never sent past it
                late = DeadlineExceededError("the request's deadline passed while held")
                await self._refused(msg, late)  # its client is told why, when it asks
                return
            try:
                await self.conn.publish_acked(
                    infer_subject(model, scope),
                    msg.data,
                    stream=self.parts.stream.name,
                    headers=headers,
                    timeout=self.conn.settings.request_timeout,
                )
                break
            except (*STREAM_GONE, *LINK_DOWN) as exc:
                log.debug("forward not answered (a link down); holding on", error=repr(exc))
                pause = FORWARD_RETRY_S  # refused at once, by the leaf or our own client
            except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
                if isinstance(exc, APIError) and not for_now(exc):
                    why = refused_for_good(exc, "the hub refused it")
                    await self._refused(msg, why)
                    return  # for good: answered with a typed error, not held forever
                log.debug("the hub cannot take it now; holding on", error=repr(exc))
                # Full, electing a leader or too slow: the pause doubles.
                busy = pause = min(max(busy * 2, RETRY_S), BUSY_MAX_S)
            if deadline is not None:  # tried last at its deadline; then it is over
                pause = min(pause, max(0.0, deadline - time.time()))
            await asyncio.sleep(pause)
            if time.monotonic() - last_progress > OUTBOX_ACK_WAIT_S / 3:
                with contextlib.suppress(nats.errors.Error):
                    await msg.in_progress()
                last_progress = time.monotonic()
        self.forwarded += 1
        self._reached_hub.set()
        self._reached_hub = asyncio.Event()
        self.forward_order.append(_held_id(msg))
        with contextlib.suppress(nats.errors.Error):
            await msg.ack_sync(timeout=FORWARD_ACK_S)
        log.info("held request forwarded", request_id=_held_id(msg))

    async def keep_error(self, request_id: str, fingerprint: str, why: MeshError) -> None:
        """Keep ``why`` as the answer of the held request ``request_id`` (the request
        ``fingerprint`` names): its client hears it when it asks by id, and the forwarder lets
        it go unsent. An answer kept before it stays (the kept stream drops a second outcome
        under the request id)."""
        headers = {MSG_ID_HEADER: request_id, kept.FINGERPRINT_HEADER: fingerprint}
        await with_site_streams(
            self.conn,
            lambda: self.conn.publish_acked(
                kept_subject(request_id),
                dump(error_event(why, request_id), WireFormat.MSGPACK),
                stream=KEPT_STREAM,
                headers=headers,
            ),
        )

    def keep_error_soon(self, request_id: str, fingerprint: str, why: MeshError) -> None:
        """:meth:`keep_error` in a task of its own (for a request whose task is ending), tried
        for a few seconds."""

        async def keep() -> None:
            for _ in range(KEEP_ERROR_TRIES):
                try:
                    await self.keep_error(request_id, fingerprint, why)
                    return
                except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
                    log.warning("held request's end not kept yet", error=repr(exc))
                    await asyncio.sleep(RETRY_S)

        self._tasks.spawn(keep(), name="site-keep-error")

    async def _ended(self, msg: Msg) -> bool:
        """Whether the site keeps an outcome of the held request already (the same content):
        its deadline passed while it waited here, or an earlier forward of it was answered (its
        outbox ack lost). Not known (the kept stream cannot be read now): False, and it is
        sent."""
        try:
            found = await self.conn.site_jsm().get_msg(
                KEPT_STREAM, subject=kept_subject(_held_id(msg)), direct=True
            )
        except (APIError, asyncio.TimeoutError, nats.errors.Error):
            return False  # NotFoundError among them: nothing kept
        return (found.headers or {}).get(kept.FINGERPRINT_HEADER) == _fingerprint(msg)

    async def _refused(self, msg: Msg, why: MeshError) -> None:
        """A held request the hub will never take (or not in time): keep its typed error as its
        answer (so its client hears it, now or when it asks again) and let the outbox go on."""
        request_id = _held_id(msg)
        try:
            await self.keep_error(request_id, _fingerprint(msg), why)
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("refused request not answered; retrying in a second", error=repr(exc))
            await hand_back([msg], RETRY_S)  # one at a time: not after its ack wait (30 s)
            return
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await msg.ack_sync(timeout=self.conn.settings.request_timeout)
        log.warning("held request refused", request_id=request_id, reason=why.message)

    # -- collector -----------------------------------------------------------------------------
    async def _collect_loop(self) -> None:
        # The consumer is a worker's to create, at each answer it keeps for this site; an edge
        # under credentials may only look it up and pull from it.
        consumer = site_consumer(self.scope)
        answers = (self.conn.jsm(), self.conn.api_prefix, ANSWERS_STREAM, consumer)
        await self._pulled("collect", answers, COLLECT_PULL_S, self._collect, 16)

    async def _collect(self, msg: Msg) -> None:
        try:
            await self._keep(msg)
        except asyncio.CancelledError:
            await hand_back([msg])  # stopping: the next collector need not wait ack_wait
            raise

    async def _keep(self, msg: Msg) -> None:
        """Keep one answer at the site, then ack it at the hub."""
        request_id = msg.subject.rsplit(".", 1)[-1]
        fingerprint = (msg.headers or {}).get(kept.FINGERPRINT_HEADER, "")
        try:
            await with_site_streams(
                self.conn,
                lambda: self.conn.publish_acked(
                    kept_subject(request_id),
                    msg.data,
                    stream=KEPT_STREAM,
                    headers={MSG_ID_HEADER: request_id, kept.FINGERPRINT_HEADER: fingerprint},
                ),
            )
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("answer not kept at the site; the hub sends it again", error=repr(exc))
            await hand_back([msg], RETRY_S)  # not after the consumer's ack wait (30 s)
            return
        self.collected += 1
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await msg.ack()
        log.info("answer collected", request_id=request_id)


async def with_site_streams(conn: Connection, op: Callable[[], Awaitable[T]]) -> T:
    """``op`` (a read or a write of a site stream); when it finds the stream gone, the site's
    streams put back at once (the connection's "site streams" step, named as restoring
    meanwhile) and ``op`` tried once more. Before, only a reconnect put them back: every request
    that could wait failed ``unavailable`` while ``/ready`` said ``ready``."""
    try:
        return await op()
    except STREAM_GONE as exc:
        conn.recovery.again(SITE_STREAMS, f"a site stream is gone: {exc!r}")
        await conn.recovery.settled(SITE_STREAMS, STREAMS_BACK_S)
    return await op()


def _deadline_of(msg: Msg) -> float | None:
    """A held request's deadline (Unix seconds), if it has one and it can be read."""
    with contextlib.suppress(MeshError):
        raw = load(msg.data, sniff(msg.data, msg.headers))
        deadline = raw.get("deadline") if isinstance(raw, dict) else None
        if isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
            return float(deadline)
    return None


def _outbox_parts(subject: str) -> tuple[str, str]:
    """(model, scope) of ``mesh.v1.outbox.<model>.<scope>``."""
    parts = subject.split(".")
    return parts[3], parts[4]


def _held_id(msg: Msg) -> str:
    return (msg.headers or {}).get(HELD_ID_HEADER, "")


def _fingerprint(msg: Msg) -> str:
    """The fingerprint of a held request (its outbox message id is ``<id>.<fingerprint>``)."""
    return (msg.headers or {}).get(MSG_ID_HEADER, "").rpartition(".")[2]
