"""An edge's view of the node registry (:mod:`mesh.registry`): who is alive, with no consumer.

It subscribes to its pool's republished updates (``mesh.v1.reg.worker.<pool>.>``), then reads
the entries with a batched direct get, and reads them afresh after every reconnect; an update
heard during a read wins over an older entry the read returns (by stream sequence). A worker the
server says nobody listens for is forgotten at once (:meth:`NodeView.gone`), not when its entry
ages out.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.registry import (
    HANDBACK,
    KEYS,
    NodeInfo,
    is_deleted,
    jetstream_errors,
    lacks,
    open_bucket,
    read_entries,
)
from protocol.errors import MeshError, UnavailableError
from protocol.subjects import NODES_STREAM, REGISTRY_UPDATES, model_token

log = get_logger(__name__)
FORGET_AFTER_TTLS = 10
"""Ttls after which a node not heard from is forgotten (it was not live long before)."""
LOOK_EVERY_S = 1.0
"""While the registry is quiet, how often its stream is looked at (:attr:`NodeView.silent`)."""


class NodeView:
    """An edge's live view of the registry. ``serves(model)`` is None until the first full
    snapshot arrives (then callers cannot tell and should not guess), else True/False.

    With ``pool`` (a model's subject token) it follows that pool's workers only: each worker's
    heartbeat then reaches the edges of its own pool, not every edge of the mesh, and questions
    about other models are answered None (cannot tell). Without, it follows every worker.

    It creates no consumer: it subscribes to the bucket's republished updates
    (``mesh.v1.reg.worker.<pool>.>``), then reads the entries with a batched direct get (see
    the module's doc); again after every reconnect."""

    def __init__(
        self,
        conn: Connection,
        ttl: float,
        pool: str | None = None,
        stream: StreamSettings | None = None,
    ) -> None:
        """``stream``: the settings a bucket this view makes (none there yet) is made with, its
        replicas first; made without, it had one replica, and no worker raised it after."""
        self._conn = conn
        self._ttl = ttl
        self._stream = stream
        self.pool = pool
        self._keys = f"worker.{pool}.>" if pool else "worker.>"
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}
        self._seqs: dict[str, int] = {}
        """Each key's newest stream sequence applied."""
        self._gone: dict[str, tuple[int, float]] = {}
        """Keys of workers found gone (:meth:`gone`): entries up to this sequence are old news,
        until this ``time.monotonic()`` (a ``ttl`` on: by then the bucket has aged out every
        entry written before, and a recreated bucket, whose sequences start at 1 again, must
        not have its new entries taken for old ones)."""
        self._ready = False
        self._sub: Subscription | None = None
        self._syncing: dict[str, int] | None = None
        """While a snapshot is read: each key's newest stream sequence seen, live or read."""
        self._lock = asyncio.Lock()
        self._synced = False
        """A read of the entries has succeeded (since the start)."""
        self._undo_reconnect: Any = None
        self._reconnected_at = -float("inf")
        self._updated: dict[str, float] = {}
        """When each node's last update came (a read after a reconnect is not one: it may hold
        the entry of a worker that died meanwhile)."""
        self._heard = time.monotonic()
        """When the last update came, from any node: a registry silent for a ``ttl`` as a
        whole (its stream electing a leader, its bucket refusing writes) ages every entry at
        once, which says nothing of the workers themselves (:meth:`serves`)."""
        self._unanswered: dict[str, float] = {}
        """Workers that did not answer an edge's question in time, and when (``no_answer``)."""
        self._works_at = -float("inf")
        """When a look last found the registry working (:attr:`silent`)."""
        self._looked_at = -float("inf")
        self._looking: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Follow the registry. Raises (a :class:`MeshError`) when it cannot be read now (no
        JetStream, or the bucket has no republish yet): the view then tries again by itself,
        as after a reconnect (the connection's "registry watch" step, pending meanwhile), and
        is not ready until it can."""
        self._undo_reconnect = self._conn.on_reconnect("registry watch", self._rewatch)
        try:
            await self._sync()
        except MeshError as exc:
            self._conn.recovery.again("registry watch", f"first read: {exc.message}")
            raise

    async def _rewatch(self) -> None:
        """After a reconnect the bucket may have been recreated, and updates were missed: read
        it afresh. Entries seen before stay until they age out; a live worker refreshes its own
        within a heartbeat. Raises when it cannot be read now (an election, no quorum, no
        republish yet): the connection's recovery tries again until it can, and the view is
        not ready meanwhile."""
        if self._synced:  # what it saw before may be stale: trusted again after a ttl
            self._reconnected_at = time.monotonic()
        self._ready = False
        await self._sync()

    async def _sync(self) -> None:
        """Subscribe to the updates (once: the client subscribes again after each reconnect),
        then read the entries, then be ready."""
        async with self._lock:
            try:
                with jetstream_errors("opening"):
                    try:
                        missing = lacks((await self._conn.jsm().stream_info(NODES_STREAM)).config)
                    except nats.js.errors.NotFoundError:
                        # Made with what it needs, and the hub's replicas (an edge first back).
                        await open_bucket(self._conn, self._ttl, self._stream)
                        missing = []
                if missing:
                    raise UnavailableError(
                        f"node registry bucket lacks {' and '.join(missing)}: a worker adds it "
                        "when it starts (edges follow the registry without a consumer)"
                    )
                if self._sub is None:
                    self._sub = await self._conn.nc.subscribe(
                        f"{REGISTRY_UPDATES}.{self._keys}", cb=self._on_update
                    )
                self._syncing = {}
                for msg in await read_entries(self._conn, self._keys):
                    self._apply(_key_of(msg.headers or {}), msg)
            except nats.errors.Error as exc:  # not connected, or a subscription refused
                raise UnavailableError(f"node registry unavailable: {exc!r}") from None
            finally:
                self._syncing = None
            self._ready = self._synced = True

    async def _on_update(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        key = msg.subject[
            len(REGISTRY_UPDATES) + 1 :
        ]  # the subject, as permitted: not a header's say
        self._apply(key, msg)
        if key in self._nodes:
            self._updated[key] = self._heard

    def _apply(self, key: str, msg: Msg) -> None:
        if not key or key.startswith(f"{HANDBACK}."):
            return  # a claim, not a node
        seq = _sequence(msg)
        if self._syncing is not None:  # a read is under way: the newest of both wins
            if seq and seq <= self._syncing.get(key, 0):
                return
            self._syncing[key] = seq
        mark = self._gone.get(key)
        if mark is not None:
            if seq and seq <= mark[0] and time.monotonic() < mark[1]:
                return  # written before the worker was found gone
            del self._gone[key]
        if is_deleted(msg):
            self._nodes.pop(key, None)
            self._seqs.pop(key, None)
            return
        self._seqs[key] = seq
        try:
            info = NodeInfo.model_validate_json(msg.data)
        except ValidationError:
            log.warning("ignoring malformed registry entry", key=key)
            return
        if key not in self._nodes:  # a node new here: the long dead go (rarely: a start)
            self._prune()
        self._nodes[key] = (info, time.monotonic())

    def _prune(self) -> None:
        """Forget nodes not heard from for ``FORGET_AFTER_TTLS`` ttls, and marks of nodes found
        gone whose time has passed: each worker that died (its id new at each start) left its
        entry here for as long as the process ran."""
        now = time.monotonic()
        old = now - FORGET_AFTER_TTLS * self._ttl
        for key, (_info, seen) in list(self._nodes.items()):
            if seen < old:
                del self._nodes[key]
                self._seqs.pop(key, None)
                self._updated.pop(key, None)
        for key, (_seq, until) in list(self._gone.items()):
            if until <= now:
                del self._gone[key]
        for node, asked in list(self._unanswered.items()):
            if asked < old:
                del self._unanswered[node]

    def gone(self, node_id: str) -> None:
        """The server says nobody listens for worker ``node_id`` (its process died, or its link
        is down): forget it now, not when its entry ages out (``ttl``). Its next heartbeat,
        if it is there after all, brings it back; an entry it wrote before (read again after a
        reconnect) does not."""
        for key, (info, _seen) in list(self._nodes.items()):
            if info.node_id == node_id:
                del self._nodes[key]
                self._gone[key] = (self._seqs.get(key, 0), time.monotonic() + self._ttl)

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
        return list(self._alive(role))

    @property
    def quiet(self) -> bool:
        """No update from any worker for a ``ttl``. Never on an edge site's leaf node
        (``hub_domain``): there a registry gone quiet is most often the site's uplink down, the
        cloud out of reach for real, and the site answers locally (or holds what can wait) as
        before."""
        if self._conn.settings.hub_domain:
            return False
        return time.monotonic() - self._heard >= self._ttl

    @property
    def silent(self) -> bool:
        """Quiet (:attr:`quiet`), and the registry itself not seen working since: the registry
        may have gone quiet, not each worker (an election, a lost hub node, a bucket refusing
        writes), and what the view shows cannot tell. A registry whose stream answers, with a
        leader, unsealed, after the last update says that the silence may be the workers' own:
        then a worker asked since, that did not answer in time (:meth:`no_answer`), is gone
        after its ``ttl`` as before (a lone worker hung with its link up, a stuck engine or a
        frozen process, read "cannot tell" until the server dropped its link: minutes). The
        look runs in the background, once a second at most, again before its word ages out."""
        if not self.quiet:
            return False
        now = time.monotonic()
        fresh = self._works_at >= self._heard and now - self._works_at < self._ttl + LOOK_EVERY_S
        aging = now - self._works_at >= self._ttl / 2
        if (not fresh or aging) and self._looking is None and now - self._looked_at >= LOOK_EVERY_S:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # read outside the loop: no look from here
                return not fresh
            self._looked_at = now
            self._looking = loop.create_task(self._look())
        return not fresh

    async def _look(self) -> None:
        """Whether the registry works: its stream answers, with a leader, unsealed."""
        try:
            reply = await self._conn.nc.request(
                f"{self._conn.api_prefix}.STREAM.INFO.{NODES_STREAM}", b"", timeout=LOOK_EVERY_S
            )
            info = orjson.loads(reply.data)
            cluster = info.get("cluster")
            led = not isinstance(cluster, dict) or bool(cluster.get("leader"))
            if "error" not in info and led and not info.get("config", {}).get("sealed"):
                self._works_at = time.monotonic()
        except (nats.errors.Error, asyncio.TimeoutError, ValueError, AttributeError, RuntimeError):
            pass  # cannot tell
        finally:
            self._looking = None

    def no_answer(self, node_id: str) -> None:
        """Worker ``node_id`` did not answer an edge's question whether it is there, in time."""
        self._unanswered[node_id] = time.monotonic()

    def heard_from(self, node_id: str) -> None:
        """Worker ``node_id`` answered an edge's question whether it is there: it is, as if its
        heartbeat had come (its own may not land while the registry refuses writes)."""
        now = time.monotonic()
        self._unanswered.pop(node_id, None)
        for key, (info, seen) in list(self._nodes.items()):
            if info.node_id == node_id and seen < now:
                self._nodes[key] = (info, now)
                self._updated[key] = now  # heard from since a reconnect, as by an update

    def _undecided(self, node_ids: list[str]) -> bool:
        """While quiet: whether these aged-out workers may still be there. Yes while the
        registry cannot be seen working, and for any of them not asked since the quiet began
        (a worker's silence is proven by its own: no answer in time)."""
        if self.silent:
            return True
        since = self._heard
        return any(self._unanswered.get(node, -float("inf")) <= since for node in node_ids)

    def askable(self) -> list[NodeInfo]:
        """The workers to ask whether they are there: the live ones, and while the registry is
        silent also those it aged out (only their own silence, or the server's word that nobody
        listens for them, tells)."""
        if not self.quiet:
            return self.live()
        return [info for info, _seen in self._nodes.values() if info.role == "worker"]

    def aged(self, model: str) -> list[str]:
        """The workers serving ``model`` whose entries aged out (not those found gone, nor
        those whose engine was down): whom to ask when the view shows none live but cannot be
        sure (an edge site's uplink was down). An answer from a worker shown down changes
        nothing: it is not asked."""
        token, now = model_token(model), time.monotonic()
        return [
            info.node_id
            for info, seen in self._nodes.values()
            if info.role == "worker"
            and not info.down
            and now - seen >= self._ttl
            and any(model_token(m) == token for m in info.models)
        ]

    def _alive(self, role: str) -> Iterator[NodeInfo]:
        """The nodes of ``role`` heard from within ``ttl``, one at a time."""
        now = time.monotonic()
        for info, seen in self._nodes.values():
            if info.role == role and now - seen < self._ttl:
                yield info

    def follows(self, model: str) -> bool:
        """Whether this view follows the workers of ``model``'s pool (every pool without one)."""
        return self.pool is None or model_token(model) == self.pool

    def serves(self, model: str) -> bool | None:
        token = model_token(model)
        if not self._ready or not self._conn.connected:
            return None
        if self.pool is not None and token != self.pool:
            return None

        def serving(info: NodeInfo) -> bool:  # its engine answering (cloud_node.engine_watch)
            return not info.down and any(model_token(m) == token for m in info.models)

        if not self.ready:  # within a ttl of a reconnect: what was read then may be stale
            known = [key for key, (info, _s) in self._nodes.items() if serving(info)]
            if any(self._updated.get(key, -math.inf) >= self._reconnected_at for key in known):
                return True  # heard from since: it is there
            return None if known else False  # none left: each found gone (or none at all)

        # Stops at the first worker that serves it: no list of nodes, no set per node.
        if any(serving(info) for info in self._alive("worker")):
            return True
        if not self.quiet:
            return False
        aged = [
            info.node_id
            for info, _seen in self._nodes.values()
            if info.role == "worker" and serving(info)
        ]
        return None if aged and self._undecided(aged) else False  # aged out with the registry

    def is_live(self, node_id: str, model: str | None = None) -> bool | None:
        """Whether the worker ``node_id`` (serving ``model``) announced itself within
        ``node_ttl``; None when the view cannot tell (yet, or not for that model's pool)."""
        if not self.ready:
            return None
        if self.pool is not None and (model is None or model_token(model) != self.pool):
            return None
        now = time.monotonic()
        ages = [now - seen for info, seen in self._nodes.values() if info.node_id == node_id]
        if any(age < self._ttl for age in ages):
            return True
        return None if ages and self.quiet and self._undecided([node_id]) else False

    async def stop(self) -> None:
        if self._looking is not None:
            self._looking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._looking
        if self._undo_reconnect is not None:
            self._undo_reconnect()
            self._undo_reconnect = None
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._ready = False


def _sequence(msg: Msg) -> int:
    """The stream sequence of a republished update or a direct get's reply; 0 if none."""
    with contextlib.suppress(ValueError):
        return int((msg.headers or {}).get("Nats-Sequence", "0"))
    return 0


def _key_of(headers: dict[str, str]) -> str:
    """The key a direct get's reply is for (``Nats-Subject: $KV.mesh_nodes.<key>``)."""
    subject = headers.get("Nats-Subject", "")
    return subject[len(KEYS) + 1 :] if subject.startswith(f"{KEYS}.") else ""
