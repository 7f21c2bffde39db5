"""The cloud worker: pulls escalated requests only as fast as it has free slots, streams each
answer on its request's token subject, and acks a request only once its outcome is stored.

Back-pressure is the pull itself: a worker asks JetStream for no more requests than it has free
slots (:mod:`cloud_node.puller`), and ``max_ack_pending`` on the consumer caps the whole fleet.

Failover continues, not restarts: a worker that dies mid-answer has its request redelivered
(``ack_wait``: seconds, as workers report progress every second). The next worker reads from
the answer store how far the answer got and continues it where its backend can continue a text
(one seamless answer), else starts it over (``start`` with seq 0, a restart to readers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from functools import partial
from typing import Any

import nats.errors
from nats import micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import Service

from cloud_node.cancels import CancelBook, allows, cancel_key_of
from cloud_node.counts import WorkerCounts, WorkerStats
from cloud_node.deferred import DeferrableHandler
from cloud_node.delivery import store_look_timeout
from cloud_node.engine_watch import EngineWatch
from cloud_node.given_up import GivenUp
from cloud_node.keeper import Keeper
from cloud_node.lease import Leases
from cloud_node.orphans import Orphans
from cloud_node.outcomes import Outcomes
from cloud_node.promises import Promises
from cloud_node.publisher import Settler
from cloud_node.puller import Puller, nak
from cloud_node.serve import Parts
from cloud_node.store_service import StoreService
from cloud_node.takeover import Takeover
from mesh import __version__, kept
from mesh.answer_store import AnswerStore
from mesh.backends.base import Backend
from mesh.config import MeshSettings
from mesh.connection import Connection, stop_service
from mesh.hub import hub_deletions, provision_hub
from mesh.lifecycle import Lifecycle, start_or_undo
from mesh.logs import get_logger
from mesh.loop_lag import LoopLag
from mesh.metrics import Exposition, NatsMetrics, WorkerMetrics, exposition, watch_gc
from mesh.provision import PROVISION_TRIES, provisioned
from mesh.registry import Heartbeat, NodeInfo, claim_room
from mesh.stream_deleted import stream_deleted, watch_deleted
from mesh.tasks import TaskSet, cancel_and_wait
from mesh.tracing import Tracing
from protocol.subjects import (
    CANCEL_WILDCARD,
    addressed,
    cloud_node_name,
    consumer_name,
    is_reply_inbox,
    model_token,
    token_subject,
    worker_cancels,
    worker_reserve_subject,
    worker_status_subject,
)

log = get_logger(__name__)
CAPACITY_POLL_S = 0.25
RESTORE = "queue and registry"
"""The worker's recovery step: its streams, the queue's consumer, its registry entry."""


class Worker(Lifecycle):
    """One worker process (or model replica) serving ``backend.model``."""

    def __init__(
        self,
        settings: MeshSettings,
        conn: Connection,
        backend: Backend,
        *,
        metrics_page: Exposition | None = None,
    ) -> None:
        """``metrics_page``: where the worker's Prometheus metrics appear (default: the process's
        page, which an edge in the same process serves too)."""
        self.settings = settings
        self.conn = conn
        self.backend = backend
        self.node_id = settings.worker.node_id
        self.counts = WorkerCounts()  # all it counts: its STATS and its Prometheus metrics
        self._nats_metrics = NatsMetrics()
        self._nats_metrics.watch(conn)
        self._page = exposition if metrics_page is None else metrics_page
        # Workers may read any answer (they continue each other's); direct get is their right.
        self.store = AnswerStore(conn, settings.stream, filtered=False)
        self.store.on_missing = self._lost
        look = store_look_timeout(settings)  # each look holds a delivery meanwhile
        self.keeper = Keeper(
            conn,
            self.store,
            settings.worker.publish_timeout,
            self._lost,
            restored=lambda within: self.conn.recovery.settled(RESTORE, within),
            look=look,
        )
        self.leases = Leases(
            conn, settings.stream.name, timeout=look, ttl=kept.lease_ttl(settings.stream)
        )
        self.leases.on_lost = self._lost
        self.takeover = Takeover(
            self.store,
            node=cloud_node_name(self.node_id),
            continues=backend.continues,
            counts=self.counts,
            timeout=look,
        )
        self.tracing = Tracing(settings.log.otel)
        self._ws = settings.worker
        self._stream = settings.stream
        # Answers acked before their store copy was confirmed, made whole in the background for
        # half as long as the store keeps answers (readers give up before that).
        self.settler = Settler(settings.stream.answer_max_age / 2, self.counts.republished)
        self.outcomes = Outcomes(
            conn,
            self.store,
            self.keeper,
            settings.stream,
            node=cloud_node_name(self.node_id),
            publish_timeout=settings.worker.publish_timeout,
            counts=self.counts,
            settle=self.settler.later,
        )
        self._reserved = 0
        self._cancels = CancelBook(ttl=self._stream.ack_wait * self._stream.max_deliver + 60)
        self._tasks = TaskSet("worker")
        parts = Parts(
            conn=conn,
            backend=backend,
            store=self.store,
            takeover=self.takeover,
            outcomes=self.outcomes,
            settler=self.settler,
            cancels=self._cancels,
            tasks=self._tasks,
            tracing=self.tracing,
        )
        self.handler = DeferrableHandler(
            settings, parts, self.counts, keeper=self.keeper, leases=self.leases
        )
        self.orphans = Orphans(
            conn,
            self.store,
            settings.stream,
            node_id=self.node_id,
            alive=self._alive,
            request_limits=settings.limits.request_limits(),
            resend=self.handler.resend,
        )
        self.store_service = StoreService(conn, self.store)  # for senders that may not read it
        ended, heard, lost = self.outcomes.end_given_up, self.outcomes.on_max_deliveries, self._lost
        self.given_up = GivenUp(conn, self._stream.name, self.consumer, ended, heard, lost=lost)
        self._stopping = False
        self.promises = Promises(self.free_slots)  # to stopping peers
        self._subs: list[Subscription] = []
        self._loop_task: asyncio.Task[Any] | None = None
        self._engine_task: asyncio.Task[Any] | None = None
        self.engine = EngineWatch(backend, self._engine_changed, self.handler.moving)  # it answers?
        self._lag_task: asyncio.Task[Any] | None = None
        self._leases_back: asyncio.Task[Any] | None = None
        self._undo_reconnect: Any = None
        self._heartbeat = Heartbeat(
            conn, self.node_info, self._stream.heartbeat, self._stream.node_ttl, self._stream
        )
        self._service: Service | None = None
        self._puller = Puller(
            conn,
            self._stream.name,
            self.consumer,
            free_slots=self._to_pull,
            total_slots=lambda: self.backend.capacity().total,
            deliver=self._accept,
            expires=self._ws.fetch_timeout,
            expiry=self._pull_expiry,
            batch=self._ws.fetch_batch,
            on_lost=self._lost,
        )  # its requests asked of a consumer made anew since are gone with the one before:
        self.handler.epoch.on_made_anew = lambda _c, began: self._puller.forget(asked_before=began)
        advice = "run another worker process for this engine (docs/performance.md)"
        # How late its event loop runs: behind, it cannot keep up with its engine.
        self.loop_lag = LoopLag("worker", advice=advice, on_tick=self.handler.stalls.tick)
        self.metrics.loop_lag.set_function(lambda: self.loop_lag.lag)
        self.metrics.in_flight.set_function(lambda: len(self.handler.inflight))
        self.metrics.free_slots.set_function(self.free_slots)
        self.metrics.slots.set_function(lambda: self.backend.capacity().total)
        if hasattr(self.backend, "engine"):  # its own figures (vLLM in process or behind HTTP)
            for figure in ("running", "waiting", "kv_cache"):
                read = partial(lambda f: float(getattr(backend, "engine", {}).get(f, 0.0)), figure)
                self.metrics.engine.labels(figure).set_function(read)

    @property
    def consumer(self) -> str:
        return consumer_name(self.backend.model)

    @property
    def stats(self) -> WorkerStats:
        """The STATS counters (``nats micro stats``, ``mesh status``), kept by :attr:`counts`."""
        return self.counts.stats

    @property
    def metrics(self) -> WorkerMetrics:
        """The worker's Prometheus metrics, kept by :attr:`counts`."""
        return self.counts.metrics

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Provision the hub, subscribe, announce this worker, and pull. A start that fails (or
        is cancelled) undoes what it started before its error goes on: its subscriptions and
        service close, nothing of it keeps running or answers for it."""
        await start_or_undo(self._start(), self.stop, "worker", node_id=self.node_id)

    async def _start(self) -> None:
        await self._provision()
        nc = self.conn.nc
        subs = self._subs = []  # each as it is made: an undone start closes those it has
        subs.append(await nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel))
        subs.append(await nc.subscribe(worker_cancels(self.node_id), cb=self._on_cancel))
        # One worker of the pool ends each request whose deliveries ran out (cloud_node.given_up).
        await self.given_up.start(group=f"mesh-advisories-{model_token(self.backend.model)}")
        subs += await self.orphans.subscribe()
        subs += await self.store_service.subscribe()
        self._service = await micro.add_service(
            nc,
            name="mesh-worker",
            version=__version__,
            description=f"mesh cloud worker serving {self.backend.model}",
            metadata=self._metadata(),
            stats_handler=lambda _endpoint: self.status(),
        )
        for name, subject, on in (
            ("status", worker_status_subject, self._on_status),
            ("reserve", worker_reserve_subject, self.promises.on_reserve),
        ):
            await self._service.add_endpoint(name=name, subject=subject(self.node_id), handler=on)
        await self.conn.subscribed()
        await self.engine.first()  # announced and pulling as the engine is
        await self._heartbeat.start()
        undo = [self.conn.on_reconnect("answers in flight", self._catch_up)]
        undo.append(self.conn.on_reconnect(RESTORE, self._restore))
        self._undo_reconnect = lambda: [u() for u in undo]
        told = dict.fromkeys(hub_deletions(self._stream, self.consumer), self._lost)  # put back
        if self.store.enabled:  # now (and answers' ends stop waiting for the store's acks)
            told[stream_deleted(self._stream.answer_stream)] = self.store.deleted
        subs += await watch_deleted(nc, told)  # once RESTORE is there to run
        for registry in (self.metrics.registry, self._nats_metrics.registry):
            self._page.add(registry)
        watch_gc(self._page)
        await self._puller.start()
        self._loop_task = self._tasks.supervise(self._tick, name="pull")
        self._engine_task = self._tasks.supervise(self.engine.run, name="engine")
        # Not one of self._tasks: those are drained for up to drain_grace on stop, and its
        # ticks count the stand-stills (handler.stalls) until the last answer is drained.
        self._lag_task = asyncio.get_running_loop().create_task(
            self.loop_lag.run(), name="loop-lag"
        )
        log.info(
            "worker started",
            node_id=self.node_id,
            model=self.backend.model,
            slots=self.backend.capacity().total,
            consumer=self.consumer,
            continues=self.backend.continues,
        )

    async def _provision(self, tries: int = PROVISION_TRIES) -> None:
        """Idempotent; asked again while JetStream answers slowly (:func:`provisioned`); in a
        restore once: its recovery retries sooner, where these held it 1 s more (review S27a)."""
        since = self.store.losses
        model = [self.backend.model]
        step = partial(provision_hub, self.conn.jsm(), self._stream, model, leases_required=False)
        hub = await provisioned(step, tries)
        self.leases.enabled, self.given_up.readable = hub.leases, hub.given_up
        if hub.given_up and self._subs:  # it listened to the advisory so far: read from now on
            await self.given_up.use(read=True)
        self.store.back(since)
        await self.handler.epoch.look(self._stream.name, self.consumer)  # ahead of deliveries
        back = self._leases_back
        if not hub.leases and (back is None or back.done()):  # until it is: Leases.restore
            config = kept.leases_config(self._stream)
            self._leases_back = self._tasks.supervise(
                lambda: self.leases.restore(lambda: kept.ensure(self.conn.jsm(), config)),
                name="leases",
            )

    async def _catch_up(self) -> None:
        """After a reconnect, what the old socket held may be lost: publish again what the store
        lacks of every answer in flight (readers' gaps close now), and hand back deliveries."""
        self.handler.recheck()  # another worker may have been handed what we held
        owed, last = self._puller.outstanding, self._puller.last_delivery  # what the link took
        self._puller.forget()  # pull requests that expired while the link was down
        await self._puller.measure()  # perhaps another server, another link
        await self._puller.top_up()
        if owed:  # the server may have sent some of it into the link that went
            self._tasks.spawn(self.orphans.hand_back_unstarted(self.consumer, last), name="lost")
        publishers = list(self.handler.publishers.values())
        results = await asyncio.gather(*(p.catch_up() for p in publishers), return_exceptions=True)
        for publisher in publishers:
            self.counts.republished(publisher)
        if publishers:
            confirmed = sum(1 for r in results if r is True)
            log.info(
                "caught up answers after a reconnect", answers=len(publishers), confirmed=confirmed
            )

    async def _restore(self) -> None:
        """After a reconnect or a loss: put back what may be lost (idempotent), announce this
        worker, and cover its free slots (the pulls of a lost consumer ended with it)."""
        self.handler.epoch.forget()  # the consumer may have been made anew
        await self._provision(tries=1)
        await self._heartbeat.beat()
        await self._puller.top_up(whole=True)

    def _alive(self, address: str) -> dict[str, bool]:
        """Its "are you there?" word on ``address``; an edge counts it out when it stops or its
        engine is down."""
        word = self.handler.alive(address)
        word = {**word, "stopping": True} if self._stopping else word
        return {**word, "down": True} if self.engine.down else word

    def _lost(self, why: str) -> None:
        """The server says a stream or the queue's consumer is gone (its deletion's advisory, a
        pull ended "Consumer Deleted", no answer to a publish): put it back now."""
        if not self._stopping:
            self.handler.epoch.forget()
            self.conn.recovery.again(RESTORE, why)

    async def stop(self) -> None:
        """Ordered: stop pulling, let in-flight requests finish (grace), hand the rest on."""
        if self._stopping:
            return
        self._stopping = True
        self.store.let_go()  # nobody puts it back now
        self.handler.epoch.close()
        if self._undo_reconnect is not None:
            self._undo_reconnect()
        # No new work first: its pull requests end at the server before anything is handed
        # back (a nak to a request still open came straight back, a delivery burnt each time),
        # as its registry entry goes: edges, and peers stopping beside it, stop counting on it.
        await asyncio.gather(self._puller.stop(), self._heartbeat.stop())
        tasks = (self._loop_task, self._engine_task, self._leases_back)
        await cancel_and_wait([t for t in tasks if t is not None])
        grace, pool = self._ws.drain_grace, model_token(self.backend.model)
        if self.handler.inflight and self._ws.hand_over:  # others continue them from the store
            claim = partial(claim_room, self.conn, pool, self.node_id)
            grace = grace if await self.handler.hand_over(claim) else 0.0
        if self.handler.inflight:
            log.info("draining in-flight requests", count=len(self.handler.inflight), grace_s=grace)
        await self._tasks.close(grace=grace)
        await cancel_and_wait([t for t in (self._lag_task,) if t is not None])
        await self.given_up.stop()
        self.outcomes.stopping = True  # closed before the settler: none settles after it
        await self.outcomes.exhausted.close(grace=self._ws.publish_timeout)
        await self.settler.close()
        await self.orphans.close()
        await self.store_service.close()
        for sub in filter(None, self._subs):
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        await stop_service(self.conn, self._service, self.conn.settings.request_timeout)
        for registry in (self.metrics.registry, self._nats_metrics.registry):
            self._page.remove(registry)
        log.info("worker stopped", node_id=self.node_id, **self.counts.snapshot())

    async def _engine_changed(self) -> None:
        """The engine went down or came back: its free slots covered (first: an announcement
        may wait on the registry); announced now."""
        await self._puller.top_up(whole=True)
        await self._heartbeat.beat()

    def _metadata(self) -> dict[str, str]:
        capacity = self.backend.capacity()
        return {
            "node_id": self.node_id,
            "model": self.backend.model,
            "backend": type(self.backend).__name__,
            "slots": str(capacity.total),
            "continues": str(self.backend.continues).lower(),
        }

    def status(self) -> dict[str, Any]:
        """What ``nats micro stats mesh-worker`` and ``mesh status`` show of this worker."""
        return {
            "node_id": self.node_id,
            "model": self.backend.model,
            "slots": self.backend.capacity().total,
            "free": self.free_slots(),
            "in_flight": len(self.handler.inflight),
            # What a reconnect took and is not back yet (the queue's consumer, the registry);
            # else whether edges can see it (its announcement in the registry is failing).
            "health": (
                "restoring"
                if self.conn.restoring
                else f"engine down: {self.engine.down}"
                if self.engine.down
                else ("unannounced" if self._heartbeat.failing else "ok")
            ),
            "restoring": self.conn.restoring,
            "handed_back": self.orphans.handed_back,
            "leases": self.leases.enabled,  # off: the lease stream is being asked for again
            # Late by tens of ms, its tokens reach clients that much late: it cannot keep up.
            **self.loop_lag.stats(),
            **self.counts.snapshot(),
        }

    async def _on_status(self, request: Request) -> None:
        with contextlib.suppress(nats.errors.Error, ValueError):
            await request.respond(json.dumps(self.status()).encode())

    def node_info(self) -> NodeInfo:
        capacity = self.backend.capacity()
        return NodeInfo(
            node_id=self.node_id,
            role="worker",
            models=[self.backend.model],
            slots=capacity.total,
            free=self.free_slots(),
            version=__version__,
            down=self.engine.down or "",
        )

    # -- intake ----------------------------------------------------------------------------
    def free_slots(self) -> int:
        if self.engine.down or self._stopping:  # pull nothing to fail, or nothing at all
            return 0
        capacity = self.backend.capacity()
        return max(0, min(capacity.total - self._reserved, capacity.free))

    def _to_pull(self) -> int:  # the free slots, and those promised (cloud_node.promises)
        capacity = self.backend.capacity()
        full = bool(self.engine.down) or self._stopping or capacity.saturated
        return self.promises.to_pull(self.free_slots(), self._reserved - capacity.total, full)

    def _pull_expiry(self) -> float:  # the next pull request's (cloud_node.promises)
        covered = self.free_slots() <= self._puller.outstanding
        return self.promises.expiry(covered, self._ws.fetch_timeout)

    async def _tick(self) -> None:
        """Cover free slots not covered: freed by the engine, expired, refused, a link back."""
        while not self._stopping:
            await asyncio.sleep(CAPACITY_POLL_S)
            await self._puller.tick()

    def _accept(self, msg: Msg) -> None:
        """A delivery (in the connection's read loop): reserve its slot and handle it."""
        if self._stopping:
            self._tasks.spawn(nak(msg), name="nak")
            return
        self.counts.fetched()
        self.promises.kept(msg)
        self._reserved += 1
        self._tasks.spawn(self._handle(msg), name="request")

    async def _on_cancel(self, msg: Msg) -> None:
        found = addressed(msg.subject)
        if found is None:
            return
        scope, request_id = found
        address = token_subject(scope, request_id)
        key = cancel_key_of(msg.data, msg.headers)
        self._cancels.add(address, key)
        entry = self.handler.inflight.get(address)
        held = entry is not None and allows(entry[1], key)
        # An addressed cancel: say whether it found the request here, to the sender's own inbox
        # only. The reply subject is the sender's word: named as a mesh or server subject (a
        # kept answer, a registry key, a JetStream API call), the worker's publish rights
        # would write this reply there for the sender, in any scope.
        if msg.reply and is_reply_inbox(msg.reply):
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(b'{"held": true}' if held else b'{"held": false}')
        if entry is None:
            return
        task = entry[0]
        if not held:
            self.counts.cancel_refused()
            log.warning("cancel refused: not the sender's key", request_id=request_id)
            return
        log.info("cancelling request", request_id=request_id)
        task.cancel()

    # -- one request -----------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        try:
            await self.handler.handle(msg)
        finally:
            self._reserved -= 1
            await self._puller.top_up()
