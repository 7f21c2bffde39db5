"""The node registry: JetStream KV bucket ``mesh_nodes``.

Workers announce themselves (models, slots, free slots) every ``heartbeat`` seconds under
``worker.<node_id>``, and delete their key on a clean stop. Entries expire with the bucket's TTL
when a worker dies. An edge watches the bucket and treats a worker as alive while its updates keep
arriving, timed with the edge's own clock (no clock skew between machines matters), so it can
answer locally at once when no worker serves a model instead of waiting for a start timeout, and
notice within ``node_ttl`` that the worker generating its answer is gone.

The bucket is file-backed and created by whoever needs it first; a heartbeat that finds it gone
(a server restart lost it, or someone deleted it) creates it again, and a view re-watches after
every reconnect, so the registry comes back by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any, Literal

import nats.errors
from nats.js import api
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.provision import placement
from protocol.errors import MeshError, MeshTimeoutError, UnavailableError
from protocol.subjects import NODES_BUCKET, model_token

log = get_logger(__name__)
_KEY_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")
HANDBACK = "handback"


class NodeInfo(BaseModel):
    """What a node announces about itself."""

    node_id: str
    role: Literal["worker", "edge"]
    models: list[str]
    slots: int
    free: int
    version: str = ""


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
    """The registry bucket, created on first use (idempotent). A writer passes ``stream``: the
    bucket is then created with its replicas and placement, and an existing one moved to its
    replica count."""
    js = conn.js
    try:
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
                )
            )
        if stream is not None:
            config = (await kv.status()).stream_info.config
            if config.num_replicas != stream.replicas:
                log.info("moving the registry", replicas=stream.replicas)
                config.num_replicas = stream.replicas
                await conn.jsm().update_stream(config)
        return kv
    except asyncio.TimeoutError:
        raise MeshTimeoutError("JetStream did not answer while opening the node registry") from None
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
                if time.monotonic() > deadline:
                    raise MeshTimeoutError(f"cannot announce this node: {exc!r}") from None
                await asyncio.sleep(0.2)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="heartbeat")

    async def beat(self) -> None:
        """Announce now; (re)open the bucket first when needed."""
        if self._kv is None:
            self._kv = await open_bucket(self._conn, self._ttl, self._stream)
        try:
            await asyncio.wait_for(
                self._kv.put(self._key, self._info().model_dump_json().encode()),
                max(self._interval, 1.0),
            )
        except nats.js.errors.NoStreamResponseError:
            self._kv = None  # the bucket is gone: the next beat creates it again
            raise

    async def _loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.beat()
                if failing:
                    log.info("heartbeat restored")
                failing = False
            except (asyncio.TimeoutError, nats.errors.Error, MeshError) as exc:
                if not failing:  # once per outage, not every second
                    log.warning("heartbeat failed", error=repr(exc))
                failing = True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._kv is not None:
            with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error):
                await asyncio.wait_for(self._kv.delete(self._key), self._interval)


class NodeView:
    """An edge's live view of the registry. ``serves(model)`` is None until the first full
    snapshot arrives (then callers cannot tell and should not guess), else True/False.

    With ``pool`` (a model's subject token) it follows that pool's workers only: each worker's
    heartbeat then reaches the edges of its own pool, not every edge of the mesh, and questions
    about other models are answered None (cannot tell)."""

    def __init__(self, conn: Connection, ttl: float, pool: str | None = None) -> None:
        self._conn = conn
        self._ttl = ttl
        self.pool = pool
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}
        self._ready = False
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None
        self._undo_reconnect: Any = None
        self._reconnected_at = -float("inf")

    async def start(self) -> None:
        await self._watch()
        self._undo_reconnect = self._conn.on_reconnect("registry watch", self._rewatch)

    async def _watch(self) -> None:
        kv = await open_bucket(self._conn, self._ttl)
        self._watcher = await (kv.watch(f"worker.{self.pool}.>") if self.pool else kv.watchall())
        self._task = asyncio.get_running_loop().create_task(
            self._follow(self._watcher), name="registry-watch"
        )

    async def _rewatch(self) -> None:
        """After a reconnect the bucket may have been recreated: follow it afresh. Entries seen
        before stay until they age out; a live worker refreshes its own within a heartbeat.
        Raises when the watch cannot be made now (an election, no quorum): the connection's
        recovery tries again until it can, and the view is not ready meanwhile."""
        self._reconnected_at = time.monotonic()
        self._ready = False
        await self._stop_watch()
        await self._watch()

    async def _follow(self, watcher: Any) -> None:
        async for entry in watcher:
            if entry is None:  # end of the initial snapshot
                self._ready = True
                continue
            if entry.key.startswith(f"{HANDBACK}."):
                continue  # a claim, not a node
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._nodes.pop(entry.key, None)
                continue
            try:
                info = NodeInfo.model_validate_json(entry.value)
            except ValidationError:
                log.warning("ignoring malformed registry entry", key=entry.key)
                continue
            self._nodes[entry.key] = (info, time.monotonic())

    @property
    def ready(self) -> bool:
        """True when the view can be trusted: the initial snapshot arrived, the connection is
        up, and since the last reconnect every live node has had ``ttl`` to announce itself
        again (while cut off, the view only ages: it cannot tell who died)."""
        return (
            self._ready
            and self._conn.connected
            and time.monotonic() - self._reconnected_at >= self._ttl
        )

    def live(self, role: str = "worker") -> list[NodeInfo]:
        now = time.monotonic()
        return [
            info
            for info, seen in self._nodes.values()
            if info.role == role and now - seen < self._ttl
        ]

    def serves(self, model: str) -> bool | None:
        token = model_token(model)
        if not self.ready or (self.pool is not None and token != self.pool):
            return None
        return any(token in {model_token(m) for m in info.models} for info in self.live())

    def is_live(self, node_id: str, model: str | None = None) -> bool | None:
        """Whether the worker ``node_id`` (serving ``model``) announced itself within
        ``node_ttl``; None when the view cannot tell (yet, or not for that model's pool)."""
        if not self.ready:
            return None
        if self.pool is not None and (model is None or model_token(model) != self.pool):
            return None
        now = time.monotonic()
        return any(
            info.node_id == node_id and now - seen < self._ttl
            for info, seen in self._nodes.values()
        )

    async def stop(self) -> None:
        if self._undo_reconnect is not None:
            self._undo_reconnect()
        await self._stop_watch()

    async def _stop_watch(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await asyncio.wait_for(watcher.stop(), 2.0)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
