"""One delivery of a queued request as a worker's handler sees it (:class:`Delivery`), and how
an attempt lets its message go once the request's outcome is out (:class:`Release`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg

from cloud_node.publisher import AnswerPublisher
from cloud_node.takeover import unseen_attempt
from mesh.config import MeshSettings
from mesh.queue import MSG_ID_HEADER
from protocol.errors import ErrorCode, MeshError
from protocol.messages import ErrorEvent, InferRequest, queued_request_id
from protocol.stream import AnswerState

Ack = Callable[[Msg], Awaitable[None]]


def delivery_of(ack_subject: str) -> tuple[str, int, int] | None:
    """(stream, times delivered, stream sequence) from a JetStream ack subject, in either of its
    forms (``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>...`` or, with a domain and account
    hash, ``$JS.ACK.<domain>.<hash>.<stream>...``); None when it is not one."""
    tokens = ack_subject.split(".")
    if tokens[:2] != ["$JS", "ACK"]:
        return None
    if len(tokens) == 9:
        stream, delivered, sseq = tokens[2], tokens[4], tokens[5]
    elif len(tokens) >= 12:
        stream, delivered, sseq = tokens[4], tokens[6], tokens[7]
    else:
        return None
    if not (delivered.isascii() and delivered.isdigit() and sseq.isascii() and sseq.isdigit()):
        return None  # "¹" is a digit to isdigit() and not to int() (a forged start: review S20a)
    return stream, int(delivered), int(sseq)


def queued_id(msg: Msg) -> str | None:
    """The id a queued request that names none is answered under (its stream sequence's,
    :func:`protocol.messages.queued_request_id`); None when ``msg`` is no JetStream message."""
    try:
        return queued_request_id(msg.metadata.sequence.stream)
    except (nats.errors.Error, AttributeError, ValueError):
        return None


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

    def answers_anew(self, request: InferRequest, history: AnswerState) -> bool:
        """Whether the finished answer the store holds under ``request``'s id is another queue
        message's, to be answered anew: this one was queued by hand (:attr:`shares_id`) and the
        answer's last start names no delivery of this message, and it has the same content
        (``nats req`` run twice) or an id derived from a queue made anew since (its sequence
        numbers start over). Another content's is ``duplicate``; this message's own (its ack
        lost) is made final."""
        if not self.shares_id or self.maybe_held:
            return False
        meta = self.msg.metadata
        held = delivery_of(history.delivery or "")
        # Its own: a delivery of its sequence, written after it was queued (its attempts number
        # by the clock, above its queue time; a queue made anew gives a sequence again).
        queued_us = meta.timestamp.timestamp() * 1_000_000
        if held is not None and held[2] == meta.sequence.stream and history.attempt >= queued_us:
            return False
        outcome = history.outcome
        duplicate = isinstance(outcome, ErrorEvent) and outcome.code == ErrorCode.DUPLICATE.value
        return not duplicate or request.id == queued_id(self.msg)

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
