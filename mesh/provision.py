"""Idempotent JetStream provisioning: the work-queue stream and one durable pull consumer per model.

Safe to run from every worker at start-up and from ``mesh provision``: an existing stream or
consumer is updated to the configured limits, never recreated (queued requests survive).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from nats.js.manager import JetStreamManager

from mesh.config import StreamSettings, WorkerSettings
from mesh.logs import get_logger
from protocol.errors import MeshError, MeshTimeoutError, UnavailableError
from protocol.subjects import (
    GIVEN_UP_STREAM,
    INFER_WILDCARD,
    consumer_name,
    given_up_subject,
    model_infer_filter,
)

log = get_logger(__name__)

T = TypeVar("T")


def placement(settings: StreamSettings) -> api.Placement | None:
    """Where a cluster puts the hub's streams (None: the provisioning server's cluster)."""
    if settings.placement_cluster is None and not settings.placement_tags:
        return None
    return api.Placement(
        cluster=settings.placement_cluster, tags=list(settings.placement_tags) or None
    )


def stream_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.name,
        description="mesh: escalated inference requests (work queue)",
        subjects=[INFER_WILDCARD],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE if settings.storage == "file" else api.StorageType.MEMORY,
        max_msgs=settings.max_msgs,
        max_bytes=settings.max_bytes,
        max_age=settings.max_age,
        discard=api.DiscardPolicy.NEW,
        max_msgs_per_subject=settings.max_msgs_per_scope,
        discard_new_per_subject=settings.max_msgs_per_scope > 0,
        duplicate_window=settings.duplicate_window,
        num_replicas=settings.replicas,
        placement=placement(settings),
    )


def consumer_config(settings: StreamSettings, model: str) -> api.ConsumerConfig:
    name = consumer_name(model)
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        description=f"mesh: workers serving {model}",
        filter_subject=model_infer_filter(model),
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
        max_waiting=512,
    )


GIVEN_UP_ACK_WAIT_S = 30.0
"""How long a worker has to end a given-up request before another is handed its advisory."""


def given_up_config(settings: StreamSettings) -> api.StreamConfig:
    """The stream keeping the queue's given-up advisories until a worker ends each
    (:mod:`cloud_node.given_up`)."""
    return api.StreamConfig(
        name=GIVEN_UP_STREAM,
        description="mesh: queued requests whose deliveries ran out, until a worker ends each",
        subjects=[given_up_subject(settings.name, "*")],
        retention=api.RetentionPolicy.WORK_QUEUE,
        storage=api.StorageType.FILE if settings.storage == "file" else api.StorageType.MEMORY,
        max_msgs=settings.max_msgs,  # never more than the queue holds
        max_age=settings.max_age,  # nor longer: its request is gone by then
        discard=api.DiscardPolicy.OLD,
        num_replicas=settings.replicas,
        placement=placement(settings),
    )


def given_up_consumer_config(settings: StreamSettings, model: str) -> api.ConsumerConfig:
    """One pool's given-up advisories (the durable named as its queue consumer)."""
    name = consumer_name(model)
    return api.ConsumerConfig(
        name=name,
        durable_name=name,
        description=f"mesh: requests for {model} whose deliveries ran out",
        filter_subject=given_up_subject(settings.name, name),
        deliver_policy=api.DeliverPolicy.ALL,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=GIVEN_UP_ACK_WAIT_S,
        max_deliver=-1,
        max_waiting=512,
    )


async def ensure_given_up(
    jsm: JetStreamManager, settings: StreamSettings, models: list[str]
) -> None:
    """The given-up stream and each pool's consumer on it (idempotent)."""
    managed = ("subjects", "max_msgs", "max_age", "discard", "num_replicas")
    await ensure_config(jsm, given_up_config(settings), managed)
    for model in dict.fromkeys(models):
        config = given_up_consumer_config(settings, model)
        await _add_consumer(jsm, GIVEN_UP_STREAM, config, f"the given-up consumer for {model}")


NOT_ANSWERING_RETRY_S = 0.5
"""When to ask JetStream again after a 503 while provisioning."""


def refused(what: str, exc: APIError) -> UnavailableError:
    """A JetStream API error while provisioning ``what``, as a typed error. A 503 means no
    JetStream answered yet (a server just started or electing a leader; or none enabled for this
    account): it says so and carries ``retry_after``, which a worker starting up waits on."""
    if isinstance(exc, ServiceUnavailableError) or exc.code == 503:
        return UnavailableError(
            f"JetStream is not answering about {what} (503: starting, electing a leader, or not "
            "enabled for this account)",
            retry_after=NOT_ANSWERING_RETRY_S,
        )
    return UnavailableError(f"JetStream refused {what}: {exc.description}")


PROVISION_TRIES = 4
"""How many times a node starting up asks JetStream to provision what it needs, 0.5 s more
apart each time (0.5, 1, 1.5 s), while JetStream answers slowly or not yet."""


async def provisioned(step: Callable[[], Awaitable[T]], tries: int = PROVISION_TRIES) -> T:
    """``step()`` (idempotent provisioning), asked again while JetStream is slow to answer (a
    timeout: replicated streams created on a cluster, by several workers at once) or does not
    answer yet (a 503: a server that just started), ``tries`` times in all; a refusal raises
    at once."""
    for attempt in range(1, tries):
        try:
            return await step()
        except (MeshTimeoutError, UnavailableError) as err:
            if isinstance(err, UnavailableError) and err.retry_after is None:
                raise
            log.warning("provisioning slow; trying again", error=err.message)
            await asyncio.sleep(0.5 * attempt)
    return await step()


async def ensure_config(
    jsm: JetStreamManager,
    wanted: api.StreamConfig,
    managed: tuple[str, ...],
    check: Callable[[api.StreamConfig], None] | None = None,
) -> api.StreamInfo:
    """Create the stream, or bring the ``managed`` fields of an existing one to ``wanted``
    (idempotent; never recreated, so what it holds survives). ``check`` may refuse an existing
    stream that cannot be brought there."""
    name = wanted.name or ""
    try:
        try:
            info = await jsm.stream_info(name)
        except NotFoundError:
            log.info("creating stream", stream=name)
            return await jsm.add_stream(wanted)
        have = info.config
        if check is not None:
            check(have)
        if any(_unset(getattr(have, f)) != _unset(getattr(wanted, f)) for f in managed):
            log.info("updating stream", stream=name)
            wanted.storage = have.storage  # storage cannot change on a live stream
            return await jsm.update_stream(wanted)
        return info
    except asyncio.TimeoutError:
        raise MeshTimeoutError(f"JetStream did not answer while provisioning {name}") from None
    except APIError as exc:
        raise refused(f"stream {name}", exc) from None


def _unset(value: object) -> object:
    """A limit left unset reads None here and -1 from the server: the same (else every pass
    updated the stream again, a Raft round on a replicated hub)."""
    return None if value == -1 else value


async def ensure_stream(jsm: JetStreamManager, settings: StreamSettings) -> api.StreamInfo:
    def work_queue(have: api.StreamConfig) -> None:
        if have.retention != api.RetentionPolicy.WORK_QUEUE:
            raise MeshError(
                f"stream {settings.name} exists with retention {have.retention}, not workqueue; "
                "delete it or configure another MESH_STREAM_NAME"
            )

    managed = (
        "subjects",
        "max_msgs",
        "max_bytes",
        "max_age",
        "discard",
        "max_msgs_per_subject",
        "discard_new_per_subject",
        "duplicate_window",
        "num_replicas",
    )
    wanted = stream_config(settings)
    wanted.max_msgs_per_subject = await _per_scope_limit(jsm, settings)
    return await ensure_config(jsm, wanted, managed, work_queue)


async def _per_scope_limit(jsm: JetStreamManager, settings: StreamSettings) -> int:
    """The per-scope limit to set now. Lowering it on a live queue makes JetStream drop the
    oldest queued requests of every sender above it, so while one sender holds more than
    ``max_msgs_per_scope``, the limit stays at what it holds (provisioning again, once they
    have drained, lowers it)."""
    limit = settings.max_msgs_per_scope
    if limit <= 0:
        return limit
    try:
        info = await jsm.stream_info(settings.name, subjects_filter=">")
    except NotFoundError:
        return limit
    except asyncio.TimeoutError:
        raise MeshTimeoutError(f"JetStream did not answer about {settings.name}") from None
    except APIError as exc:
        raise refused(settings.name, exc) from None
    held = max((info.state.subjects or {}).values(), default=0)
    if held > limit:
        log.warning(
            "a sender holds more queued requests than max_msgs_per_scope; the limit stays at "
            "what it holds until they drain, so that none is dropped",
            stream=settings.name,
            held=held,
            max_msgs_per_scope=limit,
        )
        return held
    return limit


async def ensure_consumer(
    jsm: JetStreamManager, settings: StreamSettings, model: str
) -> api.ConsumerInfo:
    """Create or update the model's durable pull consumer (create-or-update on servers >= 2.9)."""
    config = consumer_config(settings, model)
    return await _add_consumer(jsm, settings.name, config, f"the consumer for {model}")


async def _add_consumer(
    jsm: JetStreamManager, stream: str, config: api.ConsumerConfig, what: str
) -> api.ConsumerInfo:
    """Create or update a durable consumer, its failures typed (``what`` names it)."""
    try:
        return await jsm.add_consumer(stream, config)
    except asyncio.TimeoutError:
        raise MeshTimeoutError("JetStream did not answer while provisioning the consumer") from None
    except APIError as exc:
        raise refused(what, exc) from None


async def provision(jsm: JetStreamManager, settings: StreamSettings, models: list[str]) -> None:
    await ensure_stream(jsm, settings)
    for model in dict.fromkeys(models):
        await ensure_consumer(jsm, settings, model)
        log.debug("consumer ready", stream=settings.name, consumer=consumer_name(model))


def served_models(worker: WorkerSettings) -> list[WorkerSettings]:
    """One worker's settings per model it serves: its own model first, then ``also_serve``."""
    out = [worker]
    for entry in worker.also_serve:
        name, _, remote = entry.partition("=")
        model = worker.model.model_copy(update={"name": name, "remote_model": remote or name})
        node = f"{worker.node_id}-{re.sub(r'[^A-Za-z0-9_-]', '_', name)}"
        out.append(worker.model_copy(update={"model": model, "node_id": node, "also_serve": []}))
    return out
