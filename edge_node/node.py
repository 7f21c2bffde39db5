"""The edge daemon: answers its clients from the on-device model or escalates to the cloud pool,
and keeps answering (locally, saying so) when the cloud is slow, full or unreachable.

Clients reach it through a NATS micro service ``mesh-edge`` with four endpoints
(:mod:`edge_node.nats_intake`):

- ``mesh.v1.edge.<edge_id>.infer``: ``nats req`` with JSON or plain text gets one JSON answer;
  the SDK (``"stream": true``) gets the stream's events on its reply inbox;
- ``mesh.v1.edge.<edge_id>.cancel``: ``{"id", "inbox"}`` cancels the sender's own request;
- ``mesh.v1.edge.<edge_id>.resend``: ``{"id", "inbox", "attempt", "seq"}`` sends the sender's
  inbox the events it lacks;
- ``mesh.v1.edge.<edge_id>.answer``: ``{"id", "key"}`` fetches the kept answer of a request
  that could wait (an edge with a site).

Every request ends at its client in one complete answer or one typed error
(:mod:`protocol.stream`); :mod:`edge_node.records` scopes ids to their sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import nats.errors
from nats.micro.service import Service

from edge_node.api_keys import ApiKeys
from edge_node.http_api import EdgeHTTP, HTTPParts
from edge_node.lanes import app_key
from edge_node.nats_intake import IntakeParts, NatsIntake
from edge_node.parts import EdgeCounts
from edge_node.paths import PathParts, Paths
from edge_node.records import Record, Records, Sink
from edge_node.relay import RelayParts
from edge_node.report import canonical_line, observe
from edge_node.router import CloudBudget, Router, budget_of
from edge_node.served import CloudModels
from edge_node.site import SiteStore, wait_ended
from edge_node.site_links import SiteParts
from mesh.backends.base import Backend, health_within
from mesh.config import MeshSettings
from mesh.connection import Connection, stop_service
from mesh.lifecycle import Lifecycle, start_or_undo
from mesh.logs import bound, get_logger, trace_id
from mesh.loop_lag import LoopLag
from mesh.metrics import NatsMetrics, exposition, watch_gc
from mesh.node_view import NodeView
from mesh.queue import WITHDRAW_S
from mesh.tasks import TaskSet, answered_cancel, raise_if_cancelled
from mesh.tracing import Tracing
from protocol.codec import error_event
from protocol.errors import (
    CancelledByClientError,
    DeadlineExceededError,
    DuplicateRequestError,
    ErrorCode,
    MeshError,
    OverloadedError,
    UnavailableError,
)
from protocol.fingerprint import Fingerprints
from protocol.messages import EndEvent, ErrorEvent, InferRequest
from protocol.subjects import (
    STATUS_ASK,
    edge_infer_subject,
    edge_status_subject,
    model_token,
)

log = get_logger(__name__)


class EdgeNode(Lifecycle):
    """Composes the edge's parts, handing each what it uses (never the node itself): the NATS
    intake, the HTTP API, the paths (local, cascade, site, cloud relays) and the site."""

    def __init__(
        self, settings: MeshSettings, conn: Connection, backend: Backend, router: Router
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.backend = backend
        self.router = router
        self.edge_id = settings.edge.edge_id
        self.scope = settings.nats.scope_or(self.edge_id)
        self.node_name = f"edge:{self.edge_id}"
        self.counts = EdgeCounts()
        self.stats = self.counts.stats
        """Counters for ``nats micro stats mesh-edge``."""
        self.metrics = self.counts.metrics
        """Prometheus metrics (``/metrics`` on the HTTP API)."""
        self._nats_metrics = NatsMetrics()
        self._nats_metrics.watch(conn)
        self.records = Records(settings.edge.replay_window)
        self.tracing = Tracing(settings.log.otel)
        self._es = settings.edge
        self.tasks = TaskSet("edge")
        """Requests in flight."""
        self._background = TaskSet("edge-background")
        self._withdrawals = TaskSet("edge-withdrawals")
        self._service: Service | None = None
        self._metadata: dict[str, str] = {}
        self._status_sub: Any = None
        self._undo_resync: Callable[[], None] = lambda: None
        self.accepting = False
        self.nodes = NodeView(
            conn,
            settings.stream.node_ttl,
            pool=model_token(settings.edge.cloud_model),
            stream=settings.stream,
        )
        self.models = CloudModels(conn, settings.stream, self.nodes, self.scope)
        """Whether the cloud serves a model: the one rule (:mod:`edge_node.served`)."""
        self.site = (
            SiteStore(
                SiteParts(
                    conn=conn,
                    edge_id=self.edge_id,
                    scope=self.scope,
                    creds_file=settings.nats.creds_file,
                    edge=settings.edge,
                    stream=settings.stream,
                    models=self.models,
                )
            )
            if settings.nats.hub_domain
            else None
        )
        """The site's own JetStream (on a leaf node): requests that can wait, held."""
        relay = RelayParts(
            conn=conn,
            edge_id=self.edge_id,
            scope=self.scope,
            edge=settings.edge,
            stream=settings.stream,
            worker=settings.worker,
            models=self.models,
            nodes=self.nodes,
            tracing=self.tracing,
            counts=self.counts,
            withdrawals=self._withdrawals,
        )
        self.paths = Paths(
            PathParts(
                node_name=self.node_name,
                backend=backend,
                router=router,
                edge=settings.edge,
                worker=settings.worker,
                counts=self.counts,
                models=self.models,
                relay=relay,
                site=self.site,
            )
        )
        """Which path answers each request, and its answer (local, cascade, site, cloud)."""
        self.intake = NatsIntake(
            IntakeParts(
                conn=conn,
                edge_id=self.edge_id,
                edge=settings.edge,
                limits=settings.limits,
                strict_decode=settings.strict_decode,
                counts=self.counts,
                records=self.records,
                tasks=self.tasks,
                serve=self.serve,
                accepting=lambda: self.accepting,
                in_flight=self._in_flight,
                stats=self.stats_data,
                site=self.site,
            )
        )
        """The NATS micro-service endpoints."""
        self.http: EdgeHTTP | None = None
        self._serving = 0  # requests in serve(), each until its answer ended
        self.loop_lag = LoopLag(
            "edge",
            advice="spread its clients over more edge processes",
            busy=lambda: self._serving > 0,
        )
        """How late the edge's event loop runs: behind, every answer it relays is late."""
        self.metrics.loop_lag.set_function(lambda: self.loop_lag.lag)
        self.metrics.in_flight.set_function(self.records.in_flight)
        self.metrics.workers_live.set_function(self._workers_alive)
        self.metrics.cloud_share.set_function(self._budget_share)
        self.metrics.cloud_threshold.set_function(lambda: float(self.router.threshold))

    @property
    def subject(self) -> str:
        return edge_infer_subject(self.edge_id)

    @property
    def budget(self) -> CloudBudget | None:
        """The router's cloud budget (routers without one have none)."""
        return budget_of(self.router)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Open the edge: the registry view, a site's streams, the NATS intake, the HTTP API.
        A start that fails (or is cancelled) undoes what it started before its error goes on:
        the intake closes, a request it took already ends in a typed error, the registry view
        stops. Nothing is left running, nor answering for this edge."""
        await start_or_undo(self._start(), self._undo_start, "edge", edge_id=self.edge_id)

    async def _undo_start(self) -> None:
        self.accepting = False
        await self._close(grace=0.0)

    async def _start(self) -> None:
        nc = self.conn.nc
        try:
            await self.nodes.start()
        except MeshError as err:  # degrade: without the registry, the start timeout decides
            log.warning("node registry unavailable", error=err.message)
        if self.site is not None:
            await self.site.start()
        self._metadata = {
            "edge_id": self.edge_id,
            "local_model": self.backend.model,
            "cloud_model": self._es.cloud_model,
            "status": "starting",
        }
        self._service = await self.intake.start(self._metadata)
        self._status_sub = await nc.subscribe(STATUS_ASK, cb=self._on_status_ask)
        self._undo_resync = self.conn.on_reconnect("client streams", self.intake.resync)
        await self.conn.subscribed()  # once start() returns, clients can reach us
        self.accepting = True
        for registry in (self.metrics.registry, self._nats_metrics.registry):
            exposition.add(registry)
        watch_gc(exposition)
        self._background.supervise(self._refresh_metadata, name="edge-metadata")
        self._background.supervise(self.loop_lag.run, name="loop-lag")
        if self._es.http_port >= 0:
            parts = HTTPParts(
                edge_id=self.edge_id,
                local_model=self.backend.model,
                edge=self._es,
                limits=self.settings.limits,
                models=self.models,
                readiness=self.readiness,
                workers_alive=self._workers_alive,
                counts=self.counts,
                serve=self.serve,
                in_flight=self._in_flight,
                has_site=self.site is not None,
                api_keys=ApiKeys(self._es.api_keys_file) if self._es.api_keys_file else None,
                app_key=self.site.app_key if self.site is not None else partial(app_key, None),
            )
            self.http = EdgeHTTP(parts, self._es.http_host, self._es.http_port)
            await self.http.start()
        log.info(
            "edge started",
            edge_id=self.edge_id,
            subject=self.subject,
            local_model=self.backend.model,
            cloud_model=self._es.cloud_model,
        )

    async def stop(self, grace: float | None = None) -> None:
        """Ordered: stop intake, let in-flight requests finish (one ``grace`` for all of them,
        ``drain_grace`` by default), cancel the rest: each ends in a typed ``unavailable``."""
        if not self.accepting:
            return
        self.accepting = False
        await self._close(self._es.drain_grace if grace is None else grace)
        log.info("edge stopped", edge_id=self.edge_id, **self.stats.snapshot())

    async def _close(self, grace: float) -> None:
        """Close whatever of the edge is open (all of it after a start, part of it after a
        start that failed), in order; requests in flight get ``grace`` seconds."""
        ends = time.monotonic() + grace
        if self._status_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._status_sub.unsubscribe()
        await self._background.close()
        self._undo_resync()
        if self.http is not None:
            await self.http.stop(max(0.0, ends - time.monotonic()))  # then a typed end
        await self.tasks.close(grace=max(0.0, ends - time.monotonic()))
        await self._withdrawals.close(grace=WITHDRAW_S)  # each is bounded
        if self.site is not None:
            await self.site.stop()
        await stop_service(self.conn, self._service, self.conn.settings.request_timeout)
        await self.intake.close(timeout=1.0)
        await self.models.close()
        await self.nodes.stop()
        budget = self.budget
        if budget is not None:
            budget.save()  # the decisions since the last periodic save
        for registry in (self.metrics.registry, self._nats_metrics.registry):
            exposition.remove(registry)

    def _in_flight(self) -> int:
        """The requests being answered: NATS's (a task each) and HTTP's."""
        return len(self.tasks) + (self.http.answering() if self.http is not None else 0)

    def _workers_alive(self) -> int:
        return len(self.nodes.live())

    def stats_data(self) -> dict[str, Any]:
        """What ``nats micro stats mesh-edge`` and ``mesh status`` show: counters and the
        router's cloud budget."""
        budget = self.budget
        return {
            **self.stats.snapshot(),
            "in_flight": self.records.in_flight(),
            "budget": budget.snapshot() if budget is not None else None,
            **self.loop_lag.stats(),
        }

    def _budget_share(self) -> float:
        budget = self.budget
        realized = budget.snapshot().get("realized") if budget is not None else None
        return float(realized) if isinstance(realized, (int, float)) else float("nan")

    async def readiness(self) -> dict[str, Any]:
        """Whether the edge can answer, and how: ``status`` is ready, degraded (answers, but
        only locally: the cloud is unreachable) or not_ready, with the reason for each part."""
        health = await health_within(self.backend)  # a hung engine: not ready, said at once
        serves = await self.models.live_now(self._es.cloud_model)
        cloud = {True: "reachable", False: "unreachable", None: "unknown"}[serves]
        checks = {
            "model": "loaded" if health.ok else f"not ready: {health.detail}",
            "nats": "connected" if self.conn.connected else "disconnected",
            "cloud": cloud,
            "intake": "open" if self.accepting else "closed",
            "recovery": (
                "restoring " + ", ".join(self.conn.restoring) if self.conn.restoring else "restored"
            ),
        }
        ready = health.ok and self.conn.connected and self.accepting
        healthy = serves is True and not self.conn.restoring
        status = "not_ready" if not ready else ("ready" if healthy else "degraded")
        reason = ""
        if not ready:
            reason = "; ".join(
                v
                for k, v in checks.items()
                if k not in ("cloud", "recovery") and v not in ("loaded", "connected", "open")
            )
        elif self.conn.restoring:
            reason = f"{checks['recovery']} after a reconnect (retrying until restored)"
        elif status == "degraded" and serves is None:
            reason = f"cannot tell yet whether a worker serves {self._es.cloud_model!r}"
        elif status == "degraded":
            reason = f"no live worker serves {self._es.cloud_model!r}: answering locally"
        return {"status": status, "reason": reason, "checks": checks, "edge_id": self.edge_id}

    async def _on_status_ask(self, _msg: Any) -> None:
        """``mesh status`` asks (see :data:`protocol.subjects.STATUS_ASK`): what the micro
        service's INFO and STATS say, on this edge's status subject."""
        status = {**self._metadata, "counters": self.stats_data()}
        with contextlib.suppress(nats.errors.Error):
            await self.conn.nc.publish(
                edge_status_subject(self.edge_id), json.dumps(status, default=str).encode()
            )

    async def _refresh_metadata(self) -> None:
        while True:
            raise_if_cancelled()  # one a readiness check's wait_for swallowed (Python 3.11)
            ready = await self.readiness()
            self._metadata.update(status=ready["status"], cloud=ready["checks"]["cloud"])
            await asyncio.sleep(1.0)

    # -- answering ------------------------------------------------------------------------
    async def _past_deadline(self, record: Record, req: InferRequest) -> None:
        """End a request whose deadline passed first (see :func:`wait_ended` for one that can
        wait at the edge's site)."""
        err = (
            wait_ended(req, held=record.held)
            if record.deferred
            else DeadlineExceededError(
                "the request's deadline passed before its answer ended", request_id=req.id
            )
        )
        log.info("request past its deadline", code=err.code.value)
        await record.fail(err)

    async def serve(
        self,
        req: InferRequest,
        sink: Sink,
        *,
        scope: str,
        received: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> Record | None:
        """Answer one validated request into ``sink``: route, generate or relay, and report.

        Every entry (NATS micro service, HTTP API) goes through here. A request sent again under
        an id its sender already used joins the first one. Returns the request's record once
        its answer is complete (None when the id was refused as a duplicate).
        """
        fingerprints = Fingerprints(req)  # the client's request's, and its queued copy's
        try:
            record, new = self.records.open(scope, req.id, fingerprints.lazily(req.model))
        except DuplicateRequestError as err:
            self.counts.refused(err)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(err, req.id))
            return None
        except Exception:  # never silence: the client hears of it
            log.exception("request crashed before it began", request_id=req.id)
            failure = MeshError("edge failure", code=ErrorCode.INTERNAL, request_id=req.id)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(failure, req.id))
            return None
        if not new:
            self.stats.inc("rejoined")
            try:
                await record.attach(sink)
            except OverloadedError as err:
                self.counts.refused(err)
                with contextlib.suppress(MeshError):
                    await sink.send(error_event(err, req.id))
                return None
            return record
        record.sinks.append(sink)
        record.task = asyncio.current_task()
        record.expire_at(
            req.deadline if req.deadline is not None else time.time() + self._es.request_timeout
        )
        received = time.perf_counter() if received is None else received
        traced = trace_id((trace or {}).get("traceparent"))
        with bound(
            request_id=req.id, node_id=self.node_name, **({"trace_id": traced} if traced else {})
        ):
            self._serving += 1
            self.loop_lag.wake()
            try:
                with self.tracing.span(
                    "mesh.edge.request", trace, **{"mesh.request_id": req.id}
                ) as span:
                    await self.paths.answer(req, record, received, trace, fingerprints)
                    if span is not None and isinstance(record.state.outcome, EndEvent):
                        span.set_attribute("mesh.path", record.state.outcome.path)
                if not record.done:  # never silence: a path that returned without an outcome
                    log.error("answer ended without an outcome", positions=record.state.positions)
                    await record.fail(
                        MeshError("the edge lost track of the answer", code=ErrorCode.INTERNAL)
                    )
            except asyncio.CancelledError:
                if record.expired:  # its deadline passed
                    answered_cancel()
                    await self._past_deadline(record, req)
                    return record
                if self.accepting:  # the client's cancel
                    answered_cancel()
                    log.info("request cancelled by client")
                    self.stats.inc("cancelled")
                    await record.fail(CancelledByClientError("cancelled", request_id=req.id))
                    return record
                # Shutdown ran past its grace period: tell the client to retry elsewhere.
                await record.fail(
                    UnavailableError("edge is shutting down", retry_after=1.0, request_id=req.id)
                )
                raise
            except MeshError as err:
                log.info("request failed", code=err.code.value, error=err.message)
                await record.fail(err)
            except Exception:
                log.exception("request crashed")
                await record.fail(MeshError("edge failure", code=ErrorCode.INTERNAL))
            finally:
                self._serving -= 1
                record.disarm()
                record.task = None
                self.records.finished(record)
                canonical_line(record, received, streaming=sink.streaming)
                observe(self.metrics, record)
                outcome = record.state.outcome  # counted once, whoever ended it (a worker too)
                if isinstance(outcome, ErrorEvent) and outcome.code != ErrorCode.CANCELLED.value:
                    self.stats.inc(f"error.{outcome.code}")
        return record
