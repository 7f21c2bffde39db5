"""JetStream's word that a stream was deleted, taken as it comes.

``nats stream rm`` deletes a hub stream under nodes that stay connected. Nothing on the
connection says so: a publish whose subject a reader also subscribes to gets neither an ack nor
"no responders", and a node that waited for a missing ack to tell it lost a second or more on
the first answer after it. The server says it at once, on
``$JS.EVENT.ADVISORY.STREAM.DELETED.<stream>``: a node subscribes there for each stream it puts
back and acts when the word comes.

Anyone allowed to publish on that subject could say it falsely (least-privilege credentials let
nobody but the server). A false word costs a provisioning pass, which leaves a stream in place
as it is, and publishes that end unconfirmed and are published again later: nothing is lost.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

DELETED_PREFIX = "$JS.EVENT.ADVISORY.STREAM.DELETED."


def deleted_subject(stream: str) -> str:
    """Where JetStream says ``stream`` was deleted."""
    return f"{DELETED_PREFIX}{stream}"


async def watch_deleted(
    nc: Client, streams: Mapping[str, Callable[[str], None]]
) -> list[Subscription]:
    """Subscribe for the deletion of each stream of ``streams``; its callback is told why
    ("<stream> was deleted"). The subscriptions are plain ones: nats-py makes them again after a
    reconnect."""

    def told(stream: str, then: Callable[[str], None]) -> Callable[[Msg], Awaitable[None]]:
        async def handle(_msg: Msg) -> None:
            then(f"{stream} was deleted")

        return handle

    return [
        await nc.subscribe(deleted_subject(stream), cb=told(stream, then))
        for stream, then in streams.items()
    ]
