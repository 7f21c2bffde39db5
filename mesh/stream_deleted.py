"""JetStream's word that a stream or a consumer was deleted, taken as it comes.

``nats stream rm`` or ``nats consumer rm`` deletes a hub stream or the queue's consumer under
nodes that stay connected. Nothing on the connection need say so: a publish whose subject a
reader also subscribes to gets neither an ack nor "no responders", and a worker with every slot
busy has no pull open that could end "consumer deleted". A node that waited for a missing ack
or its next pull to tell it lost a second or more. The server says it at once, on
``$JS.EVENT.ADVISORY.STREAM.DELETED.<stream>`` and
``$JS.EVENT.ADVISORY.CONSUMER.DELETED.<stream>.<consumer>``: a node subscribes there for what
it puts back and acts when the word comes. A sender hears the other half,
``$JS.EVENT.ADVISORY.CONSUMER.CREATED.<stream>.<consumer>``: its queue put back.

Anyone allowed to publish on those subjects could say it falsely (least-privilege credentials
let nobody but the server). A false word costs a provisioning pass, which leaves what is in
place as it is, and publishes that end unconfirmed and are published again later; a false
"created" costs a sender one look at the consumer. Nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.credentials import may_subscribe
from mesh.logs import get_logger
from mesh.tasks import cancel_and_wait
from protocol.subjects import consumer_name

if TYPE_CHECKING:
    from mesh.connection import Connection

log = get_logger(__name__)


def stream_deleted(stream: str) -> str:
    """Where JetStream says ``stream`` was deleted."""
    return f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}"


def consumer_created(stream: str, consumer: str) -> str:
    """Where JetStream says ``consumer`` of ``stream`` was made (``*``: any consumer): a sender
    whose queue was lost hears there that it is back (:mod:`mesh.queue_watch`)."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.CREATED.{stream}.{consumer}"


def consumer_deleted(stream: str, consumer: str) -> str:
    """Where JetStream says ``consumer`` of ``stream`` was deleted."""
    return f"$JS.EVENT.ADVISORY.CONSUMER.DELETED.{stream}.{consumer}"


def queue_words(stream: str) -> list[str]:
    """Where JetStream says a consumer of the queue ``stream`` was made or deleted: what a
    sender hears (its queue put back, a pool gone), and what edges may hear."""
    return [consumer_created(stream, "*"), consumer_deleted(stream, "*")]


async def watch_deleted(
    nc: Client, told: Mapping[str, Callable[[str], None]]
) -> list[Subscription]:
    """Subscribe to each advisory subject of ``told``; its callback is told why (what was
    deleted). The subscriptions are plain ones: nats-py makes them again after a reconnect."""

    def then(subject: str, tell: Callable[[str], None]) -> Callable[[Msg], Awaitable[None]]:
        kind, _, name = subject.removeprefix("$JS.EVENT.ADVISORY.").partition(".DELETED.")
        why = f"{kind.lower()} {name} was deleted"

        async def handle(_msg: Msg) -> None:
            tell(why)

        return handle

    return [await nc.subscribe(subject, cb=then(subject, tell)) for subject, tell in told.items()]


async def hear(
    conn: Connection, subject: str, cb: Callable[[Msg], Awaitable[None]]
) -> Subscription | None:
    """Subscribe to ``subject``, sure that the server took it: None when it refused (the
    connection's credentials were minted before they allowed it). A sender may only count on
    the word once it is sure to hear it: its credentials allow it, and the server said no
    refusal before it answered a flush sent after the subscription (a refusal comes after the
    subscription, not as its answer). Raises when the server does not answer in time."""
    if not may_subscribe(conn.claims, subject):
        return None
    sub = await conn.nc.subscribe(subject, cb=cb)
    try:
        await conn.subscribed()
    except BaseException:  # not sure of it (or cancelled): not kept
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
        raise
    if subject.lower() in conn.refused_subscriptions:  # said before the flush's answer
        await sub.unsubscribe()
        return None
    return sub


async def listen(
    conn: Connection, subject: str, cb: Callable[[Msg], Awaitable[None]], what: str
) -> tuple[Subscription | None, bool]:
    """:func:`hear`, said in the log: the subscription (None: not heard), and whether to try
    again later (the server did not answer in time, or the link was down)."""
    try:
        sub = await hear(conn, subject, cb)
    except (nats.errors.Error, asyncio.TimeoutError, RuntimeError) as exc:
        log.info(f"cannot hear {what} now", error=repr(exc))
        return None, True
    if sub is None:
        log.warning(f"may not hear {what} (its credentials): looking instead")
    return sub, False


async def unlisten(listening: asyncio.Task[None] | None, sub: Subscription | None) -> None:
    """Undo :func:`listen`: the task subscribing, cancelled and waited for, then the
    subscription it made, ended (best effort: the link may be gone)."""
    if listening is not None:
        await cancel_and_wait([listening])
    if sub is not None:
        with contextlib.suppress(nats.errors.Error, RuntimeError):
            await sub.unsubscribe()


def models_named(word: Msg, models: Iterable[str]) -> list[str]:
    """The models whose pool's consumer a consumer word (made, deleted) names."""
    consumer = word.subject.rpartition(".")[2]
    return [model for model in models if consumer_name(model) == consumer]
