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
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import nats.errors
import structlog
from nats.micro.service import Service

from edge_node.cascade import Cascade
from edge_node.confidence import ConfidenceGate
from edge_node.http_api import EdgeHTTP
from edge_node.local_gate import LocalGate
from edge_node.nats_intake import NatsIntake
from edge_node.records import Record, Records, Sink
from edge_node.relay import CloudRelay, Fallback, estimate_prompt_tokens
from edge_node.report import canonical_line, observe
from edge_node.router import CloudBudget, Router, decide
from edge_node.site import SiteStore
from mesh.backends.base import Backend, Chunk, ScoringBackend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.generate import generate_into
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger, trace_id
from mesh.metrics import Counters, EdgeMetrics, NatsMetrics, exposition
from mesh.provision import model_is_served
from mesh.registry import NodeView
from mesh.tasks import TaskSet
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
    UnknownModelError,
)
from protocol.messages import EndEvent, InferRequest, RouteDecision, TokenEvent
from protocol.stream import AnswerWriter, request_fingerprint
from protocol.subjects import edge_infer_subject, model_token

log = get_logger(__name__)
_SERVED_TTL_S = {True: 30.0, False: 3.0}


class EdgeNode(Lifecycle):
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
        self.metrics = Counters()
        """Counters for ``nats micro stats mesh-edge``."""
        self.prom = EdgeMetrics()
        """Prometheus metrics (``/metrics`` on the HTTP API)."""
        self._nats_metrics = NatsMetrics()
        self._nats_metrics.watch(conn)
        self.records = Records(settings.edge.replay_window)
        self.tracing = Tracing(settings.log.otel)
        self._es = settings.edge
        self._gate = LocalGate(backend, self._es.local_queue)
        self.intake = NatsIntake(self)
        """The NATS micro-service endpoints."""
        self._cascade = self._make_cascade()
        self.tasks = TaskSet("edge")
        """Requests in flight."""
        self._background = TaskSet("edge-background")
        self._served: dict[str, tuple[bool, float]] = {}
        self._service: Service | None = None
        self._metadata: dict[str, str] = {}
        self.accepting = False
        self.nodes = NodeView(
            conn, settings.stream.node_ttl, pool=model_token(settings.edge.cloud_model)
        )
        self.site = SiteStore(self) if settings.nats.hub_domain else None
        """The site's own JetStream (on a leaf node): requests that can wait, held."""
        self.http: EdgeHTTP | None = None
        self.prom.in_flight.set_function(self.records.in_flight)
        self.prom.workers_live.set_function(lambda: len(self.nodes.live()))
        self.prom.cloud_share.set_function(self._budget_share)
        self.prom.cloud_threshold.set_function(lambda: float(self.router.threshold))

    @property
    def subject(self) -> str:
        return edge_infer_subject(self.edge_id)

    @property
    def budget(self) -> CloudBudget | None:
        """The router's cloud budget (routers without one have none)."""
        return getattr(self.router, "budget", None)

    def _make_cascade(self) -> Cascade | None:
        confidence = self._es.router.confidence
        if not confidence.enabled:
            return None
        if not isinstance(self.backend, ScoringBackend):
            log.warning(
                "mid-answer escalation needs a backend that scores tokens; it is off",
                backend=type(self.backend).__name__,
            )
            return None
        budget = self.budget
        return Cascade(
            self.backend,
            self._gate,
            ConfidenceGate(confidence),
            stall=self.settings.worker.stall_timeout,
            may_escalate=budget.mid_answer if budget is not None else lambda: True,
        )

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
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
        # Once start() returns, the server knows our subscriptions: clients can reach us.
        await nc.flush(timeout=max(1, round(self.conn.settings.request_timeout)))
        self.accepting = True
        for registry in (self.prom.registry, self._nats_metrics.registry):
            exposition.add(registry)
        self._background.supervise(self._refresh_metadata, name="edge-metadata")
        if self._es.http_port >= 0:
            self.http = EdgeHTTP(self, self._es.http_host, self._es.http_port)
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
        ends = time.monotonic() + (self._es.drain_grace if grace is None else grace)
        await self._background.close()
        if self.http is not None:
            await self.http.stop()  # stops accepting; in-flight HTTP answers get the grace
        await self.tasks.close(grace=max(0.0, ends - time.monotonic()))
        if self.site is not None:
            await self.site.stop()
        if self._service is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._service.stop()
        await self.nodes.stop()
        budget = self.budget
        if budget is not None:
            budget.save()  # the decisions since the last periodic save
        for registry in (self.prom.registry, self._nats_metrics.registry):
            exposition.remove(registry)
        log.info("edge stopped", edge_id=self.edge_id, **self.metrics.snapshot())

    def refused(self, error: MeshError) -> None:
        """A request refused before it was served (unreadable, invalid, over a limit, no room,
        its id taken): counted where the served ones are, in the STATS counters ``mesh status``
        shows and in Prometheus (``path="none"``, as every request that ended in an error)."""
        code = error.code.value
        self.metrics.inc(f"error.{code}")
        self.prom.requests.labels(path="none", route="none", outcome="error").inc()
        self.prom.errors.labels(code=code).inc()

    def stats(self) -> dict[str, Any]:
        """What ``nats micro stats mesh-edge`` and ``mesh status`` show: counters and the
        router's cloud budget."""
        budget = self.budget
        return {
            **self.metrics.snapshot(),
            "in_flight": self.records.in_flight(),
            "budget": budget.snapshot() if budget is not None else None,
        }

    def _budget_share(self) -> float:
        budget = self.budget
        realized = budget.snapshot().get("realized") if budget is not None else None
        return float(realized) if isinstance(realized, (int, float)) else float("nan")

    async def readiness(self) -> dict[str, Any]:
        """Whether the edge can answer, and how: ``status`` is ready, degraded (answers, but
        only locally: the cloud is unreachable) or not_ready, with the reason for each part."""
        health = await self.backend.health()
        serves = self.nodes.serves(self._es.cloud_model)
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
        healthy = serves is not False and not self.conn.restoring
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
        elif status == "degraded":
            reason = f"no live worker serves {self._es.cloud_model!r}: answering locally"
        return {"status": status, "reason": reason, "checks": checks, "edge_id": self.edge_id}

    async def _refresh_metadata(self) -> None:
        while True:
            ready = await self.readiness()
            self._metadata.update(status=ready["status"], cloud=ready["checks"]["cloud"])
            await asyncio.sleep(1.0)

    # -- answering ------------------------------------------------------------------------
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
        try:
            record, new = self.records.open(scope, req.id, request_fingerprint(req))
        except DuplicateRequestError as err:
            self.refused(err)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(err, req.id))
            return None
        if not new:
            self.metrics.inc("rejoined")
            try:
                await record.attach(sink)
            except OverloadedError as err:
                self.refused(err)
                with contextlib.suppress(MeshError):
                    await sink.send(error_event(err, req.id))
                return None
            return record
        record.sinks.append(sink)
        record.task = asyncio.current_task()
        received = time.perf_counter() if received is None else received
        traced = trace_id((trace or {}).get("traceparent"))
        with structlog.contextvars.bound_contextvars(
            request_id=req.id, node_id=self.node_name, **({"trace_id": traced} if traced else {})
        ):
            try:
                with self.tracing.span(
                    "mesh.edge.request", trace, **{"mesh.request_id": req.id}
                ) as span:
                    await self._answer(req, record, received, trace)
                    if span is not None and isinstance(record.state.outcome, EndEvent):
                        span.set_attribute("mesh.path", record.state.outcome.path)
                if not record.done:  # never silence: a path that returned without an outcome
                    log.error("answer ended without an outcome", positions=record.state.positions)
                    await record.fail(
                        MeshError("the edge lost track of the answer", code=ErrorCode.INTERNAL)
                    )
            except asyncio.CancelledError:
                if self.accepting:  # the client's cancel
                    log.info("request cancelled by client")
                    self.metrics.inc("cancelled")
                    await record.fail(CancelledByClientError("cancelled", request_id=req.id))
                    return record
                # Shutdown ran past its grace period: tell the client to retry elsewhere.
                await record.fail(
                    UnavailableError("edge is shutting down", retry_after=1.0, request_id=req.id)
                )
                raise
            except MeshError as err:
                self.metrics.inc(f"error.{err.code.value}")
                log.info("request failed", code=err.code.value, error=err.message)
                await record.fail(err)
            except Exception:
                self.metrics.inc("error.internal")
                log.exception("request crashed")
                await record.fail(MeshError("edge failure", code=ErrorCode.INTERNAL))
            finally:
                record.task = None
                self.records.finished(record)
                canonical_line(record, received, streaming=sink.streaming)
                observe(self.prom, record)
        return record

    # -- routing ---------------------------------------------------------------------------
    async def _answer(
        self,
        req: InferRequest,
        record: Record,
        received: float,
        trace: Mapping[str, str] | None,
    ) -> None:
        if req.is_expired():
            raise DeadlineExceededError(
                "the request's deadline passed before it could start", request_id=req.id
            )
        if (
            req.model is not None
            and req.model != self.backend.model
            and not await self.is_served(req.model)
        ):
            raise UnknownModelError(
                f"no worker pool serves model {req.model!r} and it is not this edge's "
                f"local model ({self.backend.model!r})",
                request_id=req.id,
            )
        decision = self._too_long_for_local(req) or decide(self.router, req)
        self.metrics.inc(f"route.{decision.decision}" + (".forced" if decision.forced else ""))
        self.prom.decisions.labels(
            decision=decision.decision, forced=str(decision.forced).lower()
        ).inc()
        # The canonical line carries the decision; this one is for following a request live.
        log.debug(
            "routed", decision=decision.decision, score=decision.score, reason=decision.reason
        )
        fallback: str | None = None
        if self._cascade_applies(req, decision):
            escalated = await self._local_first(req, decision, record, received)
            if escalated is None:
                return  # answered locally
            decision = escalated
        if (
            decision.decision == "cloud"
            and req.deferrable
            and self.site is not None
            and decision.confidence is None  # the local model began it: it can still answer
        ):
            await self.site.relay(req, decision, record)
            return
        if decision.decision == "cloud":
            local_fits = not self._too_long(req)
            chain = [req.model or self._es.cloud_model]
            if req.model is None:  # a client that names its model gets that model or nothing
                chain += self._es.cloud_fallbacks
            failed: list[str] = []
            for step, model in enumerate(chain):
                last = step == len(chain) - 1
                try:
                    relay = CloudRelay(
                        self,
                        req if step == 0 else req.model_copy(update={"model": model}),
                        decision,
                        record,
                        received,
                        trace,
                        local_fits=local_fits or not last,
                        tried="; ".join(failed) or None,
                    )
                    await relay.run()
                    return
                except Fallback as fb:
                    failed.append(f"{model}: {fb.reason}" if len(chain) > 1 else fb.reason)
                    self.metrics.inc("fallback")
                    self.prom.fallbacks.labels(reason=fb.kind).inc()
                    if not last:
                        log.warning("trying the next cloud pool", failed=model, reason=fb.reason)
            fallback = "; ".join(failed)
            log.warning("answering locally instead of the cloud", reason=fallback)
        await self._run_local(req, decision, record, received, fallback)

    def _too_long_for_local(self, req: InferRequest) -> RouteDecision | None:
        """A prompt that cannot fit the local model's context goes to the cloud, whatever the
        router thinks (unless the client insists on local)."""
        if req.route != "auto" or not self._too_long(req):
            return None
        budget = self.budget
        if budget is not None:  # not the router's choice: counted as forced, outside the share
            budget.record_forced("cloud")
        return RouteDecision(
            decision="cloud",
            reason=f"prompt too long for the local model "
            f"(~{estimate_prompt_tokens(req)} tokens, context {self._es.model.n_ctx})",
            budget=budget.snapshot() if budget is not None else None,
        )

    def _too_long(self, req: InferRequest) -> bool:
        return estimate_prompt_tokens(req) > self._es.model.n_ctx - 64

    async def is_served(self, model: str) -> bool:
        """Whether a worker pool was deployed for ``model`` (its consumer exists); cached."""
        now = time.monotonic()
        cached = self._served.get(model)
        if cached is not None and cached[1] > now:
            return cached[0]
        served = await model_is_served(self.conn.jsm(), self.settings.stream, model)
        if served is None:
            return cached[0] if cached else True  # cannot tell now: let the publish decide
        self._served[model] = (served, now + _SERVED_TTL_S[served])
        return served

    async def _run_local(
        self,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        fallback: str | None,
    ) -> None:
        async with self._gate.slot(req.id):
            await self._local_answer(req, decision, record, received, fallback)

    async def _local_answer(
        self,
        req: InferRequest,
        decision: RouteDecision,
        record: Record,
        received: float,
        fallback: str | None,
        *,
        chunks: AsyncIterator[Chunk] | None = None,
        slot_at: float | None = None,
    ) -> None:
        """The local answer, in the local slot the caller holds (``chunks``: a generation the
        caller started, e.g. with its first tokens held)."""
        writer = AnswerWriter(
            req.id,
            attempt=record.state.attempt + 1,
            node=self.node_name,
            reason=f"answering locally: {fallback}" if fallback else None,
        )
        await record.emit([writer.start()])

        async def emit(token: TokenEvent) -> None:
            await record.emit([token])

        gen = await generate_into(
            self.backend, req, writer, emit, self.settings.worker, chunks=chunks
        )
        waited = (slot_at if slot_at is not None else gen.started) - received
        await record.emit(
            [
                writer.end(
                    finish_reason=gen.finish_reason,
                    usage=gen.usage,
                    timings=gen.timings(since=received, queue_ms=waited * 1000),
                    served_by=self.node_name,
                    path="local",
                    routing=decision,
                    fallback=fallback,
                )
            ]
        )

    def _cascade_applies(self, req: InferRequest, decision: RouteDecision) -> bool:
        """Mid-answer escalation is for requests the router kept local, named no model, and
        leave the cloud time to answer."""
        if self._cascade is None or decision.decision != "local" or decision.forced:
            return False
        if req.model is not None:
            return False
        left = None if req.deadline is None else req.deadline - time.time()
        return left is None or left >= self._es.cloud_min_budget

    async def _local_first(
        self, req: InferRequest, decision: RouteDecision, record: Record, received: float
    ) -> RouteDecision | None:
        """Mid-answer escalation: answer locally unless the local model is unsure of its first
        tokens; then the decision to escalate (nothing of the local answer was sent)."""

        async def answer_locally(
            chunks: AsyncIterator[Chunk], slot_at: float, kept: RouteDecision
        ) -> None:
            await self._local_answer(
                req, kept, record, received, None, chunks=chunks, slot_at=slot_at
            )

        assert self._cascade is not None
        escalated = await self._cascade.run(req, decision, answer_locally)
        if escalated is not None:
            budget = self.budget
            if budget is not None:  # as it stands now, the escalation counted
                escalated = escalated.model_copy(update={"budget": budget.snapshot()})
            self.metrics.inc("route.cloud.mid_answer")
            self.prom.mid_answer.inc()  # the router's decision stays counted as local
        return escalated
