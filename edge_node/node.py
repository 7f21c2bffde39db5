"""The edge daemon: answers its clients from the on-device model or escalates to the cloud pool,
and keeps answering (locally, saying so) when the cloud is slow, full or unreachable.

Clients reach it on ``mesh.v1.edge.<edge_id>.infer``, a NATS micro service: ``nats req`` with
JSON or plain text gets one JSON answer; the SDK (``"stream": true``) gets token events on its
reply inbox, then an end or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

import nats.errors
import structlog
from nats import micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import Service

from edge_node.http_api import EdgeHTTP
from edge_node.local_gate import LocalGate
from edge_node.router import Router, decide
from mesh import __version__
from mesh.backends.base import Backend
from mesh.config import MeshSettings
from mesh.connection import Connection
from mesh.events import EventSink, Sink, generate_into
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger, log_unknown_fields
from mesh.metrics import Metrics
from mesh.provision import model_is_served
from mesh.queue import CANCELLER_HEADER, CloudCall, trace_headers
from mesh.registry import NodeView
from mesh.tasks import TaskSet
from protocol.codec import decode_request, sniff
from protocol.errors import (
    DeadlineExceededError,
    ErrorCode,
    MeshError,
    OverloadedError,
    UnavailableError,
    UnknownModelError,
)
from protocol.messages import (
    EndEvent,
    InferRequest,
    RestartEvent,
    RouteDecision,
    TokenEvent,
)
from protocol.subjects import CANCEL_WILDCARD, edge_infer_subject, request_id_of

log = get_logger(__name__)

# Cloud errors after which the edge answers locally instead of passing the error on.
_FALLBACK_CODES = {
    ErrorCode.OVERLOADED,
    ErrorCode.UNAVAILABLE,
    ErrorCode.TIMEOUT,
    ErrorCode.DEADLINE_EXCEEDED,
    ErrorCode.BACKEND_ERROR,
    ErrorCode.MAX_DELIVERIES,
}
_SERVED_TTL_S = {True: 30.0, False: 3.0}


class _Fallback(Exception):
    """The cloud could not serve this request; answer locally, saying why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EdgeNode(Lifecycle):
    def __init__(
        self, settings: MeshSettings, conn: Connection, backend: Backend, router: Router
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.backend = backend
        self.router = router
        self.edge_id = settings.edge.edge_id
        self.node_name = f"edge:{self.edge_id}"
        self.metrics = Metrics()
        self._es = settings.edge
        self._gate = LocalGate(backend, self._es.local_queue)
        self._tasks = TaskSet("edge")
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._served: dict[str, tuple[bool, float]] = {}
        self._service: Service | None = None
        self._cancel_sub: Subscription | None = None
        self._accepting = False
        self.nodes = NodeView(conn, settings.stream.node_ttl)
        self.http: EdgeHTTP | None = None

    @property
    def subject(self) -> str:
        return edge_infer_subject(self.edge_id)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        nc = self.conn.nc
        try:
            await self.nodes.start()
        except MeshError as err:  # degrade: without the registry, the start timeout decides
            log.warning("node registry unavailable", error=err.message)
        self._cancel_sub = await nc.subscribe(CANCEL_WILDCARD, cb=self._on_cancel)
        self._service = await micro.add_service(
            nc,
            name="mesh-edge",
            version=__version__,
            description="mesh edge node: local inference with cloud escalation",
            metadata={
                "edge_id": self.edge_id,
                "local_model": self.backend.model,
                "cloud_model": self._es.cloud_model,
            },
            stats_handler=lambda _endpoint: self.metrics.snapshot(),
        )
        await self._service.add_endpoint(
            name="infer",
            subject=self.subject,
            handler=self._on_request,
            queue_group=f"mesh-edge-{self.edge_id}",
        )
        # Once start() returns, the server knows our subscriptions: clients can reach us.
        await nc.flush(timeout=max(1, round(self.conn.settings.request_timeout)))
        self._accepting = True
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

    async def stop(self, grace: float = 10.0) -> None:
        """Ordered: stop intake, let in-flight requests finish (grace), cancel the rest."""
        if not self._accepting:
            return
        self._accepting = False
        if self._service is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._service.stop()
        if self.http is not None:
            await self.http.stop()  # stops accepting; in-flight HTTP answers finish first
        await self._tasks.close(grace=grace)
        if self._cancel_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._cancel_sub.unsubscribe()
        await self.nodes.stop()
        log.info("edge stopped", edge_id=self.edge_id, **self.metrics.snapshot())

    # -- intake ----------------------------------------------------------------------------
    async def _on_request(self, request: Request) -> None:
        # nats-py runs one subscription's callbacks one at a time: hand off, return at once.
        if not request._msg.reply:
            log.warning(
                "request without reply subject dropped; use `nats req`", subject=request.subject
            )
            return
        if not self._accepting or len(self._tasks) >= self._es.max_concurrent:
            self.metrics.inc("error.overloaded")
            sink = EventSink(
                _responder(request),
                "",
                sniff(request.data, request.headers).reply_format,
                collect=True,
            )
            reason = "edge is at its concurrency limit" if self._accepting else "edge is stopping"
            with contextlib.suppress(MeshError):
                await sink.error(OverloadedError(reason, retry_after=1.0))
            return
        self._tasks.spawn(self._serve(request), name="edge-request")

    async def _on_cancel(self, msg: Msg) -> None:
        if msg.headers and msg.headers.get(CANCELLER_HEADER) == self.node_name:
            return  # our own withdrawal of an escalation, not the client's cancel
        task = self._inflight.get(request_id_of(msg.subject))
        if task is not None:
            self.metrics.inc("cancelled")
            task.cancel()

    async def _serve(self, request: Request) -> None:
        received = time.perf_counter()
        try:
            req, fmt = decode_request(
                request.data,
                request.headers,
                limits=self.settings.limits.request_limits(),
                strict=self.settings.strict_decode,
                on_unknown=log_unknown_fields,
            )
        except MeshError as err:
            self.metrics.inc(f"error.{err.code.value}")
            log.info("request rejected", code=err.code.value, error=err.message)
            fmt = sniff(request.data, request.headers).reply_format
            with contextlib.suppress(MeshError):
                await EventSink(_responder(request), err.request_id or "", fmt, collect=True).error(
                    err
                )
            return
        sink = EventSink(_responder(request), req.id, fmt.reply_format, collect=not req.stream)
        await self.handle(req, sink, received, trace_headers(request.headers))

    async def handle(
        self,
        req: InferRequest,
        sink: Sink,
        received: float | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> None:
        """Answer one validated request into ``sink``: route, generate or relay, and report.

        Every entry (NATS micro service, HTTP API) goes through here; errors end up in the sink
        as typed errors, and a client's cancel (``mesh.v1.cancel.<id>``) stops it. ``trace``
        (W3C ``traceparent``/``tracestate``) goes on with an escalation.
        """
        received = time.perf_counter() if received is None else received
        task = asyncio.current_task()
        assert task is not None
        self._inflight[req.id] = task
        with structlog.contextvars.bound_contextvars(request_id=req.id, node_id=self.node_name):
            try:
                await self._answer(req, sink, received, trace)
            except asyncio.CancelledError:
                if self._accepting:  # the client's cancel: nobody to answer
                    log.info("request cancelled by client")
                    return
                # Shutdown ran past its grace period: tell the client to retry elsewhere.
                with contextlib.suppress(MeshError):
                    await sink.error(
                        UnavailableError(
                            "edge is shutting down", retry_after=1.0, request_id=req.id
                        )
                    )
                raise
            except MeshError as err:
                self.metrics.inc(f"error.{err.code.value}")
                log.info("request failed", code=err.code.value, error=err.message)
                with contextlib.suppress(MeshError):  # the client may be gone: nothing to tell
                    await sink.error(err)
            except Exception:
                self.metrics.inc("error.internal")
                log.exception("request crashed")
                with contextlib.suppress(MeshError):
                    await sink.error(MeshError("edge failure", code=ErrorCode.INTERNAL))
            finally:
                self._inflight.pop(req.id, None)
                _canonical_line(sink, received)

    # -- routing ---------------------------------------------------------------------------
    async def _answer(
        self, req: InferRequest, sink: Sink, received: float, trace: Mapping[str, str] | None
    ) -> None:
        if req.is_expired():
            raise DeadlineExceededError(
                "the request's deadline passed before it could start", request_id=req.id
            )
        if (
            req.model is not None
            and req.model != self.backend.model
            and not await self._is_served(req.model)
        ):
            raise UnknownModelError(
                f"no worker pool serves model {req.model!r} and it is not this edge's "
                f"local model ({self.backend.model!r})",
                request_id=req.id,
            )
        decision = self._too_long_for_local(req) or decide(self.router, req)
        self.metrics.inc(f"route.{decision.decision}" + (".forced" if decision.forced else ""))
        log.info("routed", decision=decision.decision, score=decision.score, reason=decision.reason)
        fallback: str | None = None
        if decision.decision == "cloud":
            try:
                await self._relay_cloud(req, decision, sink, received, trace)
                return
            except _Fallback as fb:
                fallback = fb.reason
                self.metrics.inc("fallback")
                log.warning("answering locally instead of the cloud", reason=fallback)
                if sink.tokens_sent:
                    await sink.restart(1, reason=f"cloud failed mid-stream: {fallback}")
        await self._run_local(req, decision, sink, received, fallback)

    def _too_long_for_local(self, req: InferRequest) -> RouteDecision | None:
        """A prompt that cannot fit the local model's context goes to the cloud, whatever the
        router thinks (unless the client insists on local)."""
        if req.route != "auto":
            return None
        estimate = len(req.text()) // 3 + 16 * req.turns()  # ~3+ chars/token for English
        limit = self._es.model.n_ctx - 64
        if estimate <= limit:
            return None
        return RouteDecision(
            decision="cloud",
            reason=f"prompt too long for the local model "
            f"(~{estimate} tokens, context {self._es.model.n_ctx})",
        )

    async def _is_served(self, model: str) -> bool:
        now = time.monotonic()
        cached = self._served.get(model)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            served = await model_is_served(self.conn.jsm(), self.settings.stream, model)
        except (MeshError, nats.errors.Error):
            return cached[0] if cached else True  # cannot tell now: let the publish decide
        self._served[model] = (served, now + _SERVED_TTL_S[served])
        return served

    # -- the two paths ---------------------------------------------------------------------
    async def _relay_cloud(
        self,
        req: InferRequest,
        decision: RouteDecision,
        sink: Sink,
        received: float,
        trace: Mapping[str, str] | None,
    ) -> None:
        model = req.model or self._es.cloud_model
        if not await self._is_served(model):
            raise _Fallback(f"no worker pool serves {model!r}")
        if self.nodes.serves(model) is False:
            raise _Fallback(f"no live worker serves {model!r}")
        start_timeout = self._es.cloud_start_timeout
        if req.deadline is not None:
            left = req.deadline - time.time()
            if left < self._es.cloud_min_budget:
                raise _Fallback(f"deadline too near for the cloud ({left:.1f}s left)")
            start_timeout = min(start_timeout, left)
        start_by = time.time() + start_timeout
        queued = req.model_copy(
            update={
                "model": model,
                "origin": self.edge_id,
                "routing": decision,
                "start_by": start_by,
            }
        )
        call = CloudCall(
            self.conn, self.settings.stream, queued, canceller=self.node_name, headers=trace
        )
        try:
            await call.open()
        except MeshError as err:
            raise _Fallback(f"cloud queue unavailable: {err}") from None
        first_token: float | None = None
        try:
            events = call.events(
                first_timeout=start_timeout, idle_timeout=self._es.cloud_idle_timeout
            )
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, TokenEvent):
                        first_token = first_token or time.perf_counter()
                        await sink.token(event.text, event.attempt)
                    elif isinstance(event, RestartEvent):
                        await sink.restart(event.attempt, event.reason)
                    else:
                        await sink.end(_edge_end(event, decision, received, first_token))
                        return
        except MeshError as err:
            await call.withdraw()
            if err.code in _FALLBACK_CODES:
                where = "start" if first_token is None else "finish"
                raise _Fallback(f"cloud did not {where}: {err}") from None
            raise
        except asyncio.CancelledError:
            await call.withdraw()
            raise
        finally:
            await call.close()

    async def _run_local(
        self,
        req: InferRequest,
        decision: RouteDecision,
        sink: Sink,
        received: float,
        fallback: str | None,
    ) -> None:
        async with self._gate.slot(req.id):
            gen = await generate_into(self.backend, req, sink, self.settings.worker)
        await sink.end(
            EndEvent(
                id=req.id,
                seq=0,
                path="local",
                served_by=self.node_name,
                routing=decision,
                fallback=fallback,
                finish_reason=gen.finish_reason,
                usage=gen.usage,
                timings=gen.timings(since=received, queue_ms=(gen.started - received) * 1000),
            )
        )


def _canonical_line(sink: Sink, received: float) -> None:
    """One log line per request with everything an operator asks about it."""
    fields: dict[str, Any] = {
        "total_ms": round((time.perf_counter() - received) * 1000, 1),
        "stream": not sink.collect,
        "tokens": sink.tokens_sent,  # token messages; the engine's count replaces it below
    }
    end = sink.last_end
    if end is not None:
        fields.update(
            tokens=end.usage.completion_tokens,
            outcome="ok",
            path=end.path,
            served_by=end.served_by,
            finish=end.finish_reason,
            ttft_ms=end.timings.ttft_ms,
            fallback=end.fallback,
        )
        if end.routing is not None:
            fields.update(
                route=end.routing.decision, score=end.routing.score, forced=end.routing.forced
            )
    elif sink.last_error is not None:
        fields.update(outcome="error", code=sink.last_error.code.value)
    else:
        fields.update(outcome="cancelled")
    log.info("request", **fields)


def _edge_end(
    end: EndEvent, decision: RouteDecision, received: float, first_token: float | None
) -> EndEvent:
    """The worker's end, with timings as the edge's client sees them."""
    now = time.perf_counter()
    timings = end.timings.model_copy(
        update={
            "ttft_ms": round((first_token - received) * 1000, 2) if first_token else None,
            "total_ms": round((now - received) * 1000, 2),
        }
    )
    return end.model_copy(update={"timings": timings, "routing": decision, "path": "cloud"})


def _responder(request: Request) -> Any:
    async def respond(data: bytes, headers: dict[str, str]) -> None:
        try:
            await request.respond(data, headers=headers)
        except (nats.errors.Error, ValueError) as exc:
            raise MeshError(
                f"cannot reply to the client: {type(exc).__name__}", code=ErrorCode.UNAVAILABLE
            ) from None

    return respond
