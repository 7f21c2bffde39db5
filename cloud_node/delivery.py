"""One delivery of a queued request as a worker's handler sees it (:class:`Delivery`), and how
an attempt lets its message go once the request's outcome is out (:class:`Release`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.msg import Msg

from cloud_node.publisher import AnswerPublisher
from cloud_node.takeover import unseen_attempt
from mesh.config import MeshSettings
from mesh.queue import MSG_ID_HEADER
from protocol.errors import MeshError

Ack = Callable[[Msg], Awaitable[None]]


def queued_once(msg: Msg, scope: str, request_id: str) -> bool:
    """Whether ``msg`` is the queue's only message of its request: it has the message id that
    senders give (``<scope>.<id>``, a site's with a tag after it), under which JetStream drops
    any other within its duplicate window. One queued by hand (``nats pub``) may share its
    id with another, of other content: that one's answer would mix with it."""
    msg_id = (msg.headers or {}).get(MSG_ID_HEADER, "")
    own = f"{scope}.{request_id}"
    return msg_id == own or msg_id.startswith(f"{own}.")


@dataclass
class Delivery:
    """One delivery of a queued request, as it arrived."""

    msg: Msg
    attempt: int
    """The delivery count: it decides retries (an answer's attempt may number higher)."""
    received: float  # the loop time it arrived
    drops: int
    stalls: int
    """The connection's drops and the process's stand-stills when it arrived (either since
    means the delivery may have been handed to another worker: :mod:`cloud_node.orphans`)."""
    maybe_held: bool = False
    """Whether another worker may hold the request already, generating it unseen: its sender
    queued it again (:data:`mesh.queue.COPY_HEADER`), or it is older than the consumer that
    delivered it (:mod:`cloud_node.epoch`). Its answer then numbers above any attempt the other
    can reach, and it reads what the store holds first, as a redelivery does."""
    shares_id: bool = False
    """Whether another queued message may carry its request id (:func:`queued_once`): numbered
    and looking first as one :attr:`maybe_held`, so that two requests under one id never pass
    for one answer."""
    generating: bool = False
    """Set once its generation holds the message: from then on that settles it, whatever
    ends the attempt (:meth:`cloud_node.serve.Handler._generate`). Cut short before,
    :meth:`cloud_node.serve.Handler.handle` settles it."""

    def number(self) -> int:
        """The attempt number of what this delivery writes with no answer to continue (a
        rejection; a start when the store holds none): its delivery count, or above any
        attempt another worker may reach when it may hold the request (:func:`unseen_attempt`)."""
        unseen = self.maybe_held or self.shares_id
        return unseen_attempt(self.attempt) if unseen else self.attempt

    def queued_ms(self) -> float:
        """How long it waited in the queue, until now."""
        return max(0.0, (time.time() - self.msg.metadata.timestamp.timestamp()) * 1000)


class Release:
    """How an attempt lets its queue message go once the request's outcome is out: the answer
    is in the store, where its sender reads it, so the message is acked (terminated after a
    final error). A request that can wait keeps its outcome for its site first
    (:class:`cloud_node.deferred.KeepFirst`)."""

    def __init__(self, msg: Msg, ack: Ack) -> None:
        self.msg = msg
        self.ack = ack

    async def answered(self, publisher: AnswerPublisher) -> bool:
        """The whole answer is published and stored: let the message go. False when it was
        handed back instead (then the request does not count as completed here)."""
        await self.ack(self.msg)
        return True

    async def cancelled(self, err: MeshError) -> None:
        """The client cancelled it and was told: let the message go. Raising leaves it to its
        redelivery, which the cancel refuses and answers."""
        await self.msg.ack()

    async def failed(self, err: MeshError) -> bool:
        """Before a final error terminates the message: False when it was handed back."""
        return True


def store_look_timeout(settings: MeshSettings) -> float:
    """How long a worker waits on one look in the answer store or its leases while it holds a
    delivery: ``publish_timeout``, and at most a fifth of ``ack_wait`` (a longer wait would let
    the delivery lapse to another worker meanwhile)."""
    return min(settings.worker.publish_timeout, 0.2 * settings.stream.ack_wait)
