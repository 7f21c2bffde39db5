"""The node registry: JetStream KV bucket ``mesh_nodes``.

Workers announce themselves (models, slots, free slots) every ``heartbeat`` seconds under
``worker.<pool>.<node_id>``, and delete their key on a clean stop. Entries expire with the
bucket's TTL when a worker dies. An edge follows the bucket and treats a worker as alive while its
updates keep arriving, timed with the edge's own clock (no clock skew between machines matters),
so it can answer locally at once when no worker serves a model instead of waiting for a start
timeout, and notice within ``node_ttl`` that the worker generating its answer is gone.

An edge creates no JetStream consumer to follow the registry (a push consumer's deliver subject
is not checked by the server: an edge allowed to create one could have another edge's subjects
delivered to). Instead the bucket **republishes** every update on a core subject,
``mesh.v1.reg.<key>``, and a view subscribes to its pool's updates first, then
reads the current entries with one batched direct get (``multi_last``), paged, and marks itself
ready. An update heard during that read wins over an older entry the read returns (by stream
sequence).

The bucket is file-backed and created by whoever needs it first, with republish and direct gets;
a writer (a worker, passing its ``stream`` settings) adds either to an older bucket that lacks
it. A heartbeat that finds the bucket gone (a server restart lost it, or someone deleted it)
creates it again, and a view reads it afresh after every reconnect, so the registry comes back
by itself. A view on a bucket without republish yet stays not ready (it cannot follow it without
a consumer) and tries again until a writer has added it. The view is
:class:`mesh.node_view.NodeView`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import Iterator
from typing import Any, Literal

import nats.errors
import orjson
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from pydantic import BaseModel, ValidationError

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.provision import placement
from mesh.tasks import cancel_and_wait, raise_if_cancelled
from protocol.errors import MeshError, MeshTimeoutError, UnavailableError
from protocol.subjects import (
    NODES_BUCKET,
    NODES_STREAM,
    REGISTRY_UPDATES,
    model_token,
    worker_reserve_subject,
)

log = get_logger(__name__)
_KEY_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")
HANDBACK = "handback"
ASK_S = 0.5
"""How long a stopping worker waits for a peer to promise it free slots."""
CLAIM_S = 1.0
"""How long it asks its peers in all (a silent peer's entry lives up to ``node_ttl``: review
S19d's stop beside 8 of them took 4 s more, one after the other)."""
MAX_REPLY = 1024
KEYS = f"$KV.{NODES_BUCKET}"
"""The bucket's subjects: ``$KV.mesh_nodes.<key>``."""
REPUBLISH = api.RePublish(src=f"{KEYS}.>", dest=f"{REGISTRY_UPDATES}.>")
"""Every update (put, delete, purge) again on ``mesh.v1.reg.<key>``, with headers
``Nats-Subject``, ``Nats-Sequence``, ``Nats-Last-Sequence`` (and ``KV-Operation``)."""
SNAPSHOT_BATCH = 256
"""Entries a view asks for per direct get; it pages on when there are more."""


class NodeInfo(BaseModel):
    """What a node announces about itself."""

    node_id: str
    role: Literal["worker", "edge"]
    models: list[str]
    slots: int
    free: int
    version: str = ""
    down: str = ""
    """Why a worker's engine does not answer ("" while it does): it serves nothing then."""


def node_key(role: str, node_id: str, pool: str | None = None) -> str:
    """``worker.<pool>.<node>`` (a worker announces itself under its model's pool, so an edge
    can follow one pool only), or ``<role>.<node>``."""
    node = _KEY_UNSAFE.sub("_", node_id)
    return f"{role}.{pool}.{node}" if pool else f"{role}.{node}"


def handback_key(scope: str, request_id: str, attempt: int) -> str:
    """A worker's claim on handing back a dead worker's delivery (``cloud_node.orphans``): kept
    in this bucket for its atomic create and its TTL; views skip these keys."""
    return f"{HANDBACK}.{scope}.{request_id}.{attempt}"


def pool_of(info: NodeInfo) -> str | None:
    """The pool a node announces itself under: its (first) model's subject token."""
    return model_token(info.models[0]) if info.role == "worker" and info.models else None


async def open_bucket(
    conn: Connection, ttl: float, stream: StreamSettings | None = None
) -> KeyValue:
    """The registry bucket, created on first use (idempotent), with republish and direct gets
    (what a :class:`NodeView` needs). A writer passes ``stream``: the bucket is then created
    with its replicas and placement, and an existing one moved to its replica count and given
    republish and direct gets when it lacks them (a stream update: only writers may)."""
    js = conn.js
    with jetstream_errors("opening"):
        try:
            kv = await js.key_value(NODES_BUCKET)
        except BucketNotFoundError:
            return await js.create_key_value(
                api.KeyValueConfig(
                    bucket=NODES_BUCKET,
                    description="mesh node registry (heartbeats)",
                    history=1,
                    ttl=ttl,
                    storage=api.StorageType.FILE,
                    replicas=stream.replicas if stream else 1,
                    placement=placement(stream) if stream else None,
                    republish=REPUBLISH,
                    direct=True,
                )
            )
        if stream is not None:
            config = (await kv.status()).stream_info.config
            missing = lacks(config)
            if config.num_replicas != stream.replicas or missing:
                log.info("updating the registry", replicas=stream.replicas, adding=missing)
                config.num_replicas = stream.replicas
                config.republish = REPUBLISH
                config.allow_direct = True
                await conn.jsm().update_stream(config)
        return kv


def lacks(config: api.StreamConfig) -> list[str]:
    """What the bucket's stream config lacks for a :class:`NodeView` to follow it without a
    consumer: ``republish`` (onto ``mesh.v1.reg.>``) and ``allow_direct``."""
    missing = []
    republish = config.republish
    if republish is None or (republish.src, republish.dest) != (REPUBLISH.src, REPUBLISH.dest):
        missing.append("republish")
    if not config.allow_direct:
        missing.append("allow_direct")
    return missing


@contextlib.contextmanager
def jetstream_errors(doing: str) -> Iterator[None]:
    """JetStream's failures as the mesh's typed errors."""
    try:
        yield
    except asyncio.TimeoutError:
        raise MeshTimeoutError(
            f"JetStream did not answer while {doing} the node registry"
        ) from None
    except nats.js.errors.APIError as exc:
        raise UnavailableError(f"node registry unavailable: {exc.description}") from None


class Heartbeat:
    """A worker's announcement loop: put now, then every ``interval``; delete on stop."""

    def __init__(
        self,
        conn: Connection,
        info: Any,
        interval: float,
        ttl: float,
        stream: StreamSettings | None = None,
    ) -> None:
        self._conn = conn
        self._info = info  # a callable returning the current NodeInfo
        self._interval = interval
        self._ttl = ttl
        self._stream = stream
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None
        self._key = ""
        self.failing = False
        """The last announcement failed: edges stop seeing this node within ``ttl``."""

    async def start(self) -> None:
        info: NodeInfo = self._info()
        self._key = node_key(info.role, info.node_id, pool_of(info))
        # The first announcement may meet a stream electing its leader (just created, or moved
        # to another replica count): give it a few tries before giving up on starting.
        deadline = time.monotonic() + 3 * self._conn.settings.request_timeout
        while True:
            try:
                await self.beat()
                break
            except (asyncio.TimeoutError, nats.errors.Error) as exc:
                # Refused (credentials made for another node id): said at once, not as a
                # timeout after three tries (review S20a: 8 s, "TimeoutError()").
                self._conn.refusals.raise_if_refused(f"$KV.{NODES_BUCKET}.{self._key}")
                if time.monotonic() > deadline:
                    raise MeshTimeoutError(f"cannot announce this node: {exc!r}") from None
                await asyncio.sleep(0.2)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="heartbeat")

    async def beat(self) -> None:
        """Announce now; (re)open the bucket first when needed, and once more when it is gone
        (deleted: a restore heard of it, or this beat found it so)."""
        for last in (False, True):
            if self._kv is None:
                self._kv = await open_bucket(self._conn, self._ttl, self._stream)
            try:
                await asyncio.wait_for(
                    self._kv.put(self._key, self._info().model_dump_json().encode()),
                    max(self._interval, 1.0),
                )
                self._announced()
                return
            except nats.js.errors.NoStreamResponseError:
                self._kv = None  # the bucket is gone: created again, now
                if last:
                    raise

    def _announced(self) -> None:
        """An announcement went through, whoever made it: the loop's, or a restore's after a
        reconnect (which announced the node again a heartbeat before the loop's next one, and
        the node still said ``unannounced`` until then: review S27a)."""
        if self.failing:
            log.info("heartbeat restored")
        self.failing = False

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            raise_if_cancelled()  # a stop's cancel the last put's wait_for swallowed (3.11)
            try:
                await self.beat()
                raise_if_cancelled()
            except (asyncio.TimeoutError, nats.errors.Error, MeshError) as exc:
                if not self.failing:  # once per outage, not every second
                    log.warning("heartbeat failed", error=repr(exc))
                self.failing = True

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        # Cut off, or cut off meanwhile, the delete would wait out its interval for an ack that
        # cannot come (the entry ages out of every view within the TTL instead).
        if self._kv is not None:
            with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error):
                await self._conn.while_linked(self._kv.delete(self._key), self._interval)


async def read_entries(conn: Connection, key_filter: str) -> list[Msg]:
    """The last message of every key matching ``key_filter`` (``worker.<pool>.>``), deletes
    included (header ``KV-Operation``): batched direct gets (``multi_last``) on the bucket's
    stream, paged at one point in time. Needs the right to publish on
    ``$JS[.<hub domain>].API.DIRECT.GET.KV_mesh_nodes``; creates no consumer."""
    nc = conn.nc
    subject = f"{conn.api_prefix}.DIRECT.GET.{NODES_STREAM}"
    request: dict[str, Any] = {"multi_last": [f"{KEYS}.{key_filter}"], "batch": SNAPSHOT_BATCH}
    timeout = conn.settings.request_timeout
    entries: list[Msg] = []
    with jetstream_errors("reading"):
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        try:
            while True:  # one page per request
                await nc.publish(subject, json.dumps(request).encode(), reply=inbox)
                while True:
                    msg = await sub.next_msg(timeout=timeout)
                    headers = msg.headers or {}
                    if "Status" in headers:
                        break
                    if "Nats-Num-Pending" not in headers:
                        raise UnavailableError(
                            "node registry unavailable: this nats-server cannot batch direct "
                            "gets (2.11 or later is needed)"
                        )
                    entries.append(msg)
                status, why = headers["Status"], headers.get("Description", "")
                if status == "404" and why == "No Results":
                    return entries  # no such key (left)
                if status != "204":
                    raise UnavailableError(
                        f"node registry unavailable: direct get answered {status} {why}".strip()
                    )
                if int(headers.get("Nats-Num-Pending", "0")) == 0:
                    return entries
                # The next page, at the same point in time.
                request["up_to_seq"] = int(headers["Nats-UpTo-Sequence"])
                request["seq"] = int(headers["Nats-Last-Sequence"]) + 1
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()


async def live_workers(conn: Connection, pool: str | None = None) -> list[NodeInfo]:
    """The workers (of ``pool``) the registry holds now (not deleted, not expired), read without
    a consumer: what a worker asks before handing its answers over on a stop."""
    infos = []
    for msg in await read_entries(conn, f"worker.{pool}.>" if pool else "worker.>"):
        if is_deleted(msg):
            continue
        with contextlib.suppress(ValidationError):
            infos.append(NodeInfo.model_validate_json(msg.data))
    return infos


async def claim_room(conn: Connection, pool: str, node_id: str, want: int) -> int:
    """Have the other live workers of ``pool`` promise up to ``want`` free slots, and return
    how many they did: a stopping worker hands that many of its answers over rather than
    making them wait for its drain (0 when it cannot tell). Each peer grants in its own event
    loop no more than it has free less what it promised already
    (:mod:`cloud_node.promises`): two workers stopping at once never count one slot twice.
    Asked one at a time, most room first, until ``want`` is met or :data:`CLAIM_S` passed: a
    peer that does not answer at once (:data:`ASK_S`) grants nothing."""
    if want <= 0:
        return 0
    if not conn.connected:
        # Cut off: nobody could take the answers over from the store now, and the registry
        # would not answer (nats-py holds the read until it reconnects, or request_timeout).
        log.info("cut off from NATS: no hand-over; draining")
        return 0
    timeout = conn.settings.request_timeout
    try:
        live = await conn.while_linked(live_workers(conn, pool), timeout)
        peers = [info for info in live if info.node_id != node_id and not info.down]
    except (MeshError, nats.errors.Error, asyncio.TimeoutError) as exc:
        log.info("cannot tell whether another worker has room; draining", error=repr(exc))
        return 0
    granted, until = 0, time.monotonic() + CLAIM_S
    # An entry is up to a heartbeat old: each peer says what it has free now.
    for info in sorted(peers, key=lambda info: -info.free):
        left = until - time.monotonic()
        if granted >= want or left <= 0 or not conn.connected:
            break  # past CLAIM_S: peers that did not answer cost no more of the stop
        granted += await _reserve(conn, info, want - granted, min(ASK_S, left))
    return granted


async def _reserve(conn: Connection, info: NodeInfo, want: int, timeout: float) -> int:
    """The slots ``info``'s worker promised of ``want`` (0 when it does not answer within
    ``timeout``, or answers something else than a number it could grant)."""
    ask = orjson.dumps({"want": want})
    try:
        reply = await conn.nc.request(worker_reserve_subject(info.node_id), ask, timeout=timeout)
        said = orjson.loads(reply.data) if len(reply.data) <= MAX_REPLY else {}
        granted = said.get("granted")
    except (nats.errors.Error, asyncio.TimeoutError, ValueError, AttributeError):
        return 0  # orjson refuses what nests too deep (a ValueError), as it refuses bad JSON
    return max(0, min(granted, want)) if type(granted) is int else 0


async def create_once(kv: KeyValue, key: str) -> int:
    """Create ``key`` unless it is there (``KeyWrongLastSequenceError``): a claim, never
    deleted, gone with the bucket's TTL. Not nats-py's ``create``, which reads a key it finds
    back (to recreate a deleted one) with a direct get that a worker's credentials do not
    allow: the server refused it, and the create waited out its timeout."""
    return await kv.update(key, b"1", last=0)


def is_deleted(msg: Msg) -> bool:
    headers = msg.headers or {}
    return (
        headers.get(KV_OP) in (KV_DEL, KV_PURGE)
        or "Nats-Marker-Reason" in headers  # a subject delete marker (an expiry)
        or not msg.data
    )
