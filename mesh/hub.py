"""Everything the hub's workers use, provisioned in one place: the request queue and one consumer
per model (:mod:`mesh.provision`), the answer store, kept answers and leases.

Each worker runs it at start-up, and ``mesh provision`` runs it ahead of least-privilege workers,
which then find it in place. Idempotent: existing streams are brought to the configured limits,
never recreated.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.errors
from nats.js.errors import APIError
from nats.js.manager import JetStreamManager

from mesh import kept
from mesh.answer_store import ensure_answer_stream
from mesh.config import StreamSettings
from mesh.logs import get_logger
from mesh.provision import ensure_given_up, provision
from mesh.stream_deleted import consumer_deleted, stream_deleted
from protocol.errors import MeshError
from protocol.subjects import ANSWERS_STREAM, GIVEN_UP_STREAM, LEASES_STREAM, NODES_STREAM

log = get_logger(__name__)


@dataclass(frozen=True)
class Hub:
    streams: list[str]
    """The streams in place, in the order they were provisioned."""
    leases: bool
    """Whether the lease stream is among them."""
    given_up: bool = True
    """Whether the given-up stream is among them (:mod:`cloud_node.given_up`)."""


def hub_streams(settings: StreamSettings) -> list[str]:
    """The streams :func:`provision_hub` puts in place, lease stream last."""
    stored = [settings.answer_stream] if settings.answer_storage != "off" else []
    return [settings.name, *stored, ANSWERS_STREAM, GIVEN_UP_STREAM, LEASES_STREAM]


def hub_deletions(settings: StreamSettings, consumer: str) -> list[str]:
    """Where JetStream says a hub stream (the node registry's too), or the queue's ``consumer``
    of ``settings.name`` (or of ``MESH_GIVEN_UP``), was deleted: what a worker watches to put it
    back at once (``*``: any consumer)."""
    streams = [stream_deleted(name) for name in [*hub_streams(settings), NODES_STREAM]]
    consumers = [consumer_deleted(name, consumer) for name in (settings.name, GIVEN_UP_STREAM)]
    return [*streams, *consumers]


async def provision_hub(
    jsm: JetStreamManager,
    settings: StreamSettings,
    models: list[str],
    *,
    leases_required: bool = True,
) -> Hub:
    """Provision the hub for ``models``. Without ``leases_required``, a lease stream that cannot
    be had (credentials minted before it existed, say) is logged and left out: requests that can
    wait are then served without leases."""
    await provision(jsm, settings, models)
    await ensure_answer_stream(jsm, settings)
    answers = kept.answers_config(settings)
    await kept.ensure(jsm, answers)
    streams = hub_streams(settings)
    given_up = True
    try:
        await ensure_given_up(jsm, settings, models)
    except (MeshError, nats.errors.Error, APIError) as exc:
        # Credentials minted before the stream: the advisory is listened to as before.
        log.warning("given-up stream unavailable; listening to the advisory", error=repr(exc))
        streams.remove(GIVEN_UP_STREAM)
        given_up = False
    try:
        await kept.ensure(jsm, kept.leases_config(settings))
    except (MeshError, nats.errors.Error, APIError) as exc:
        if leases_required:
            raise
        log.warning("lease stream unavailable; serving without leases", error=repr(exc))
        return Hub(streams[:-1], leases=False, given_up=given_up)
    return Hub(streams, leases=True, given_up=given_up)
