"""The edge's OpenAI-compatible HTTP API (aiohttp): point any OpenAI client at an edge.

    POST /v1/chat/completions   stream or not; routes like any other request
    POST /v1/completions        a raw prompt, no chat template; stream or not
    GET  /v1/models             the local model and the cloud model
    GET  /v1/models/{model}     one of those, or a model a worker pool serves
    GET  /health                liveness: the process serves HTTP
    GET  /ready                 readiness: model loaded, NATS connected, cloud reachable
    GET  /metrics               Prometheus metrics of every node in this process

Request bodies are validated by :mod:`edge_node.openai_api`. Extensions: a ``route`` field
(``auto|local|cloud``) or an ``X-Mesh-Route`` header forces a path; every answer carries a
``mesh`` object (path, served_by, routing, fallback, timings) and ``X-Mesh-Path`` /
``X-Mesh-Served-By`` headers. Errors use OpenAI's ``{"error": {...}}`` shape with the mesh's
stable code and an HTTP status derived from it, on every route: an unknown one is a 404, a
method a route does not take a 405 (both ``invalid_request``, as OpenAI's own are
``invalid_request_error``), so a client never has to parse aiohttp's plain text.

``X-Request-Id``, when it is a token (``[A-Za-z0-9_-]``, at most 128), becomes the request's id:
the answer's ``id`` (``chatcmpl-<id>``), its ``X-Request-Id`` header, the logs and traces. HTTP
requests never join one another (each has a scope of its own): the same id sent again is
answered again. Only ``service_tier: "flex"`` gives it more meaning: such a request is kept at
the edge's site, and the same request under the same id gets the kept answer; an edge without a
site refuses it (:meth:`EdgeHTTP._parse`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST

from edge_node.api_keys import REQUEST_APP, ApiKeys, require_keys
from edge_node.http_sinks import CLIENT_STALL_S, CollectSink, SSESink, error_body, send_whole
from edge_node.openai_api import Kind, Shaper, parse, to_request, tokens_field
from edge_node.parts import EdgeCounts, Serve
from edge_node.records import HTTP_SCOPE, Sink
from edge_node.served import CloudModels
from mesh.config import EdgeSettings, LimitSettings
from mesh.logs import bound, get_logger
from mesh.metrics import cannot_listen, exposition
from mesh.tasks import answered_cancel
from mesh.tracing import trace_headers
from protocol.codec import (
    WireFormat,
    check_nesting,
    load,
    to_exception,
)
from protocol.errors import (
    ErrorCode,
    InvalidRequestError,
    MeshError,
    OverloadedError,
    PayloadTooLargeError,
    UnavailableError,
    UnknownModelError,
    status_of,
)
from protocol.messages import (
    EndEvent,
    ErrorEvent,
    InferRequest,
)
from protocol.subjects import is_token

log = get_logger(__name__)
ROUTES = (
    "POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{model}, "
    "GET /health, GET /ready and GET /metrics"
)


def error_response(
    err: MeshError, *, status: int | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    """The HTTP error for ``err``: its code's status unless ``status`` says otherwise."""
    headers = dict(headers or {})
    if err.code == ErrorCode.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    if err.retry_after:
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return web.json_response(
        error_body(err), status=status or status_of(err.code), headers=headers or None
    )


def _id_header(request_id: str | None) -> dict[str, str]:
    """The request's id, echoed on its error as on its answer (when it has one)."""
    return {"X-Request-Id": request_id} if request_id else {}


def _ended(req: InferRequest, error: MeshError | None) -> web.Response:
    """The error a request's answer ended in (or that none was produced), with its id."""
    return error_response(error or MeshError("no answer was produced"), headers=_id_header(req.id))


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route's errors in OpenAI's shape: a handler's typed error, aiohttp's own 404, 405
    and friends, and a crash, which aiohttp would answer in plain text."""
    try:
        return await handler(request)
    except MeshError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        where = f"{request.method} {request.path}"
        if isinstance(exc, web.HTTPNotFound):
            message = f"Invalid URL ({where}): this edge serves {ROUTES}"
        elif isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            message = f"Invalid method ({where}): {request.path} takes {allowed}"
        else:
            message = f"{exc.reason} ({where})"
        allow = exc.headers.get("Allow")
        return error_response(
            InvalidRequestError(message),
            status=exc.status,
            headers={"Allow": allow} if allow else None,
        )
    except Exception:
        log.exception("HTTP handler crashed", path=request.path)
        return error_response(MeshError("edge failure", code=ErrorCode.INTERNAL))


@dataclass(frozen=True)
class HTTPParts:
    """What the HTTP API uses of the edge."""

    edge_id: str
    local_model: str
    edge: EdgeSettings
    limits: LimitSettings
    models: CloudModels
    """Whether a worker pool serves a model (``GET /v1/models/{model}``)."""
    readiness: Callable[[], Awaitable[dict[str, Any]]]
    workers_alive: Callable[[], int]
    counts: EdgeCounts
    serve: Serve
    in_flight: Callable[[], int]
    """The requests the edge is answering, from NATS and HTTP: ``max_concurrent`` bounds them."""
    has_site: bool
    """Whether the edge has a site that keeps requests that can wait (``flex``)."""
    api_keys: ApiKeys | None
    """The keys ``/v1`` requests need, each naming an app (None: no keys, loopback only)."""
    app_key: Callable[[str], str]
    """The key that makes an app's kept answers its own (``""``: the HTTP clients of an edge
    without API keys, together)."""


class EdgeHTTP:
    """The HTTP server of one edge node."""

    def __init__(self, parts: HTTPParts, host: str, port: int) -> None:
        self.parts = parts
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None
        self._answering: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._created = int(time.time())
        """The ``created`` of the models this edge lists (when it began serving them)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        limits = self.parts.limits
        keys = self.parts.api_keys
        middlewares = [openai_errors] + ([require_keys(keys)] if keys is not None else [])
        app = web.Application(client_max_size=limits.max_payload_bytes, middlewares=middlewares)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)  # ids may hold a "/"
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        # A client that disconnects cancels its handler, which aborts the generation.
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=self.parts.edge.drain_grace,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            raise cannot_listen(
                "the edge's HTTP API", self.host, self.port, exc, "MESH_EDGE_HTTP_PORT"
            ) from exc
        server = site._server
        if self.port == 0 and server is not None and server.sockets:  # type: ignore[attr-defined]
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        log.info("edge HTTP API listening", url=self.url)

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening; answers under way get ``grace`` to end, then each ends with a typed
        ``unavailable`` written to its client (aiohttp's own shutdown would close their sockets
        under them: a dropped connection, a stream cut short) before the server goes."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self._stopping = True
        for site in list(runner.sites):
            await site.stop()
        if self._answering:
            _, late = await asyncio.wait(set(self._answering), timeout=grace)
            for task in late:
                task.cancel()  # the edge's serve tells the sink; the handler answers with it
            if late:
                await asyncio.wait(late, timeout=CLIENT_STALL_S)
        await runner.cleanup()

    def _listed(self) -> dict[str, str]:
        """The models ``GET /v1/models`` lists, by name: who owns each (edge or cloud)."""
        parts = self.parts
        listed = {parts.local_model: "edge"}  # one name for both: the edge's (it answers)
        listed.setdefault(parts.edge.cloud_model, "cloud")
        return listed

    def _model_object(self, name: str, owner: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": owner}

    async def _models(self, _request: web.Request) -> web.Response:
        data = [self._model_object(name, owner) for name, owner in self._listed().items()]
        return web.json_response({"object": "list", "data": data})

    def answering(self) -> int:
        """The requests being answered over HTTP."""
        return len(self._answering)

    async def _model(self, request: web.Request) -> web.Response:
        """One model, as OpenAI's ``GET /v1/models/{model}``: a listed one, or any other a
        worker pool serves (a request naming it goes to that pool)."""
        name = request.match_info["model"]
        owner = self._listed().get(name)
        if owner is None and name != "auto" and await self.parts.models.deployed(name):
            owner = "cloud"
        if owner is None:
            raise UnknownModelError(
                f"The model {name!r} does not exist here: it is neither this edge's local model "
                f"({self.parts.local_model!r}) nor served by a worker pool",
                details=[{"loc": "model", "msg": "unknown model"}],
            )
        return web.json_response(self._model_object(name, owner))

    async def _health(self, _request: web.Request) -> web.Response:
        """Liveness: this process answers HTTP (restart it if not)."""
        return web.json_response({"status": "ok", "edge_id": self.parts.edge_id})

    async def _ready(self, _request: web.Request) -> web.Response:
        """Readiness: 200 when the edge can answer (degraded: locally only), 503 when not."""
        ready = await self.parts.readiness()
        ready["workers_alive"] = self.parts.workers_alive()
        return web.json_response(ready, status=503 if ready["status"] == "not_ready" else 200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=exposition.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "completion")

    async def _answer(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        received = time.perf_counter()
        try:
            req, model, include_usage = await self._parse(request, kind)
        except MeshError as err:
            self.parts.counts.refused(err)
            asked = request.headers.get("X-Request-Id")
            return error_response(
                err, headers=_id_header(asked if asked and is_token(asked) else None)
            )
        if self._stopping:  # a connection kept open asks again while the edge stops
            return error_response(
                UnavailableError("edge is shutting down", retry_after=1.0, request_id=req.id),
                headers=_id_header(req.id),
            )
        if self.parts.in_flight() >= self.parts.edge.max_concurrent:
            busy = OverloadedError(
                "edge is at its concurrency limit", retry_after=1.0, request_id=req.id
            )
            self.parts.counts.refused(busy)
            return error_response(busy, headers=_id_header(req.id))
        answering = asyncio.current_task()
        assert answering is not None
        self._answering.add(answering)
        try:
            return await self._answer_with(request, req, kind, model, include_usage, received)
        finally:
            self._answering.discard(answering)

    async def _serve(self, req: InferRequest, sink: Sink, **kwargs: Any) -> None:
        """The edge's serve; past the grace of a stop it ends (cancelled) with a typed
        ``unavailable`` in the sink, and the handler goes on to answer with it."""
        try:
            await self.parts.serve(req, sink, **kwargs)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            answered_cancel()  # acted on: what the handler still writes is not cut by it

    async def _answer_with(  # noqa: PLR0917 - one handler's parts
        self,
        request: web.Request,
        req: InferRequest,
        kind: Kind,
        model: str,
        include_usage: bool,
        received: float,
    ) -> web.StreamResponse:
        shaper = Shaper(kind, req.id, model)
        scope = f"{HTTP_SCOPE}{uuid.uuid4().hex}"  # HTTP requests do not join each other
        trace = trace_headers(request.headers)
        app = REQUEST_APP.get()  # the app its API key names, on every line of its request
        with bound(**({"app": app} if app else {})):
            if req.stream:
                sink = SSESink(request, req, shaper, include_usage)
                try:
                    await self._serve(req, sink, scope=scope, received=received, trace=trace)
                except Exception:
                    if sink.response is None:
                        raise  # the middleware answers it, in OpenAI's shape
                    # Never a second response inside a stream begun: its end, typed.
                    log.exception("streamed answer crashed", request_id=req.id)
                    await sink.crashed()
                if sink.response is None:
                    return _ended(req, to_exception(sink.last_error) if sink.last_error else None)
                await sink.finish()
                return sink.response
            collected = CollectSink(req.id)
            await self._serve(req, collected, scope=scope, received=received, trace=trace)
            end = collected.answer.outcome
            if not isinstance(end, EndEvent):
                return _ended(req, to_exception(end) if isinstance(end, ErrorEvent) else None)
            logprobs = collected.answer.logprobs() if req.logprobs else None
            headers = {
                "X-Request-Id": req.id,
                "X-Mesh-Path": end.path,
                "X-Mesh-Served-By": end.served_by,
            }
            answer = shaper.answer(collected.answer.text(), end, logprobs)
            return await send_whole(request, answer, headers)

    async def _parse(self, request: web.Request, kind: Kind) -> tuple[InferRequest, str, bool]:
        limits = self.parts.limits
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLargeError(
                f"body over this edge's limit of {limits.max_payload_bytes} bytes"
            ) from None
        data = load(raw, WireFormat.JSON)  # the codec's rules: UTF-8, readable, not too deep
        if not isinstance(data, dict):
            raise InvalidRequestError("the body must be a JSON object")
        check_nesting(data)
        body = parse(kind, data)
        local_model = self.parts.local_model
        model = body.model or local_model
        routed = model in (local_model, "auto")  # naming the local model lets it route
        route = request.headers.get("X-Mesh-Route") or body.route or ("auto" if routed else "cloud")
        if route not in ("auto", "local", "cloud"):
            raise InvalidRequestError(f"route must be auto, local or cloud, not {route!r}")
        if route == "local":  # an explicit route wins: the local model answers, under its name
            model, routed = local_model, True
        request_id = request.headers.get("X-Request-Id")
        req = to_request(
            body,
            # Naming the local model (or "auto") lets the router choose; any other model is a
            # cloud model, and the request goes to it.
            model=None if routed else model,
            route=route,  # type: ignore[arg-type]
            request_id=request_id if request_id and is_token(request_id) else None,
        )
        if req.deferrable:
            if not self.parts.has_site:
                raise InvalidRequestError(
                    "service_tier 'flex' needs an edge at a site with JetStream of its own, "
                    "which keeps the request and its answer (MESH_NATS_HUB_DOMAIN names the "
                    "hub's domain there); this edge has none: send the request without it",
                    details=[{"loc": "service_tier", "msg": "needs an edge site"}],
                )
            # Its answer is kept at the site; an HTTP client asks again by sending the same
            # request under the same X-Request-Id. The key is its app's (with API keys; else
            # all HTTP clients'), which no NATS client holds: another app at the site, over
            # HTTP or by the NATS lookup by id (``mesh.v1.edge.<edge>.answer``), cannot have it.
            app = REQUEST_APP.get() or ""
            req = req.model_copy(update={"cancel_key": self.parts.app_key(app)})
        if req.max_tokens > limits.max_tokens:
            named = tokens_field(body)  # the field the client set
            raise InvalidRequestError(
                f"{named} {req.max_tokens} is over this edge's limit of {limits.max_tokens}",
                details=[{"loc": named, "msg": f"must be <= {limits.max_tokens}"}],
            )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return req, model, include_usage
