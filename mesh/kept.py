"""Requests that can wait: their streams, and their answers kept whole.

A request marked ``deferrable`` may outlive any connection: an edge site holds it in its own
stream ``MESH_OUTBOX`` while the uplink is down, and forwards it in order when the link returns.
The worker that answers it stores the whole answer (or its typed error) in the hub's stream
``MESH_ANSWERS`` before it acks the request; the site collects it through a durable consumer
filtered to its own scope into its stream ``MESH_KEPT``, where a client can fetch it by id.
Every hop is a JetStream write acknowledged before the previous copy is let go, and every write
carries a message id, so a link that flaps at any moment loses nothing and duplicates nothing.
"""

from __future__ import annotations

import dataclasses

from nats.js import api
from nats.js.manager import JetStreamManager

from mesh.config import StreamSettings
from mesh.logs import get_logger
from mesh.provision import ensure_config, placement
from protocol.codec import WireFormat, dump
from protocol.errors import UnavailableError
from protocol.messages import Answer, ErrorEvent, WireEvent
from protocol.stream import AnswerState
from protocol.subjects import (
    ANSWER_WILDCARD,
    ANSWERS_STREAM,
    CLAIM_WILDCARD,
    CLAIMS_STREAM,
    KEPT_STREAM,
    KEPT_WILDCARD,
    LEASE_WILDCARD,
    LEASES_STREAM,
    OUTBOX_STREAM,
    OUTBOX_WILDCARD,
    site_answers_filter,
    site_consumer,
)

log = get_logger(__name__)
MSG_ID_HEADER = "Nats-Msg-Id"
FINGERPRINT_HEADER = "Mesh-Req"
"""The kept answer's request fingerprint: what it answers, so no other request gets it."""
DEDUPE_WINDOW_S = 3600.0
"""How long a message id is remembered by these streams (a forward retried after a flap)."""


SITE_ACK_WAIT_S = 30.0
"""How long a site has to keep a collected answer before the hub delivers it again."""


def site_consumer_config(scope: str) -> api.ConsumerConfig:
    """The durable pull consumer through which the site of ``scope`` collects its kept answers
    from ``MESH_ANSWERS``. A worker creates it before it keeps the scope's first answer (see
    :class:`cloud_node.keeper.Keeper`): an edge under credentials only pulls from it, since a
    consumer an edge could create might be a push consumer delivering anywhere."""
    name = site_consumer(scope)
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=site_answers_filter(scope),
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=SITE_ACK_WAIT_S,
        max_deliver=-1,
    )


def answers_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=ANSWERS_STREAM,
        description="mesh: whole answers of requests that could wait, until their site collects",
        subjects=[ANSWER_WILDCARD],
        storage=api.StorageType.FILE,
        max_age=settings.kept_max_age,
        max_bytes=settings.kept_max_bytes,
        discard=api.DiscardPolicy.OLD,
        max_msgs_per_subject=1,
        duplicate_window=DEDUPE_WINDOW_S,
        allow_direct=True,
        num_replicas=settings.replicas,
        placement=placement(settings),
    )


def lease_ttl(settings: StreamSettings) -> float:
    """How long a lease lasts without a refresh: twice the queue's ack_wait, so the redelivery
    of a copy whose worker died (after ack_wait) still finds its own lease, and takes it over,
    while other copies of the request keep away."""
    return max(2.0, 2 * settings.ack_wait)


def leases_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=LEASES_STREAM,
        description="mesh: which queued copy of a request that can wait is being answered",
        subjects=[LEASE_WILDCARD],
        storage=api.StorageType.FILE,
        max_age=lease_ttl(settings),
        max_msgs_per_subject=1,
        discard=api.DiscardPolicy.OLD,
        duplicate_window=lease_ttl(settings),  # at most max_age; set, so provisioning is stable
        allow_direct=True,
        num_replicas=settings.replicas,
        placement=placement(settings),
    )


def outbox_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=OUTBOX_STREAM,
        description="mesh site: requests that can wait, held until the uplink carries them",
        subjects=[OUTBOX_WILDCARD],
        storage=api.StorageType.FILE,
        retention=api.RetentionPolicy.WORK_QUEUE,
        max_age=settings.outbox_max_age,
        duplicate_window=DEDUPE_WINDOW_S,
        discard=api.DiscardPolicy.NEW,
        max_msgs=settings.max_msgs,
        max_bytes=settings.outbox_max_bytes,  # a site's disk: past it, refused (overloaded)
    )


def kept_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=KEPT_STREAM,
        description="mesh site: answers of this site's requests that could wait",
        subjects=[KEPT_WILDCARD],
        storage=api.StorageType.FILE,
        max_age=settings.kept_max_age,
        max_bytes=settings.kept_max_bytes,  # a site's disk: the oldest answers go first
        discard=api.DiscardPolicy.OLD,
        max_msgs_per_subject=1,
        duplicate_window=DEDUPE_WINDOW_S,
        allow_direct=True,
    )


def claims_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=CLAIMS_STREAM,
        description="mesh site: who held each request that can wait (first come, kept)",
        subjects=[CLAIM_WILDCARD],
        storage=api.StorageType.FILE,
        # Written when the request is held; the answer it guards is kept from when it is
        # collected, which may be an outbox's age (held) and a kept age (waiting at the hub for
        # the site's uplink) later: a claim outlives its answer.
        max_age=settings.outbox_max_age + 2 * settings.kept_max_age,
        max_bytes=settings.kept_max_bytes // 8,  # full: a new hold is refused, typed
        max_msgs_per_subject=1,
        discard=api.DiscardPolicy.NEW,
        discard_new_per_subject=True,  # a later request under the same id cannot take it over
        allow_direct=True,
    )


MANAGED = (
    "subjects",
    "max_age",
    "max_bytes",
    "max_msgs",
    "max_msgs_per_subject",
    "discard",
    "discard_new_per_subject",
    "duplicate_window",
    "allow_direct",
    "num_replicas",
)
"""What provisioning brings an existing kept, outbox or claims stream to."""


async def ensure(jsm: JetStreamManager, config: api.StreamConfig) -> None:
    """Create the stream, or bring an existing one to ``config`` (idempotent). A server whose
    store cannot reserve the stream's byte limit (nats-server reserves every ``max_bytes``
    against its ``max_file_store``: a small site's leaf) gets the largest half, quarter...
    of it that it can, and a warning: the site's edge refused to start (review S19d), and a
    stream without a limit never drops its oldest answers for a new one (review S19e)."""
    limit = config.max_bytes or 0
    while True:
        try:
            await ensure_config(jsm, dataclasses.replace(config, max_bytes=limit or -1), MANAGED)
        except UnavailableError as err:
            if not limit or "insufficient storage" not in err.message:
                raise
            limit = limit // 2 if limit // 2 >= MIN_BYTES else 0  # at last: no limit of its own
            continue
        if limit != (config.max_bytes or 0):
            log.warning(
                "the JetStream store cannot reserve this stream's byte limit: kept with a "
                "smaller one (give the server a larger max_file_store)",
                stream=config.name,
                wanted=config.max_bytes,
                max_bytes=limit or None,
            )
        return


MIN_BYTES = 1024 * 1024
"""The smallest byte limit :func:`ensure` falls back to before none at all."""


def whole_answer(
    events: list[WireEvent], request_id: str, fingerprint: str
) -> Answer | ErrorEvent | None:
    """The outcome of ``events`` (an answer's stored events, in order) as one message: the whole
    verified text, or the typed error. None when the events hold no outcome yet. A start of
    another request under the id (``fingerprint``: this one's) makes it ``duplicate``: before,
    another request's text under a reused id was kept as this one's (review S20b)."""
    state = AnswerState(request_id, fingerprint=fingerprint)
    state.feed_all(events)
    return state.whole()


def encode_outcome(outcome: Answer | ErrorEvent) -> bytes:
    return dump(outcome, WireFormat.MSGPACK)
