"""The edge's NATS micro-service endpoints: requests, cancels, resends and kept answers.

Each handler checks what a client may ask (its own reply inbox, its own records) and hands the
request to the edge's entry point (:meth:`EdgeNode.serve`, given as :attr:`IntakeParts.serve`);
it returns at once, since nats-py runs one subscription's callbacks one at a time. ``infer``'s
runs in the connection's read loop (:func:`mesh.inline_sub.make_inline`): each request reaches a
task of its own without a wake-up of the subscription's task on the way.

``$SRV.STATS.mesh-edge`` counts, per endpoint, the typed errors it answered (``num_errors``,
``last_error``). nats-py's micro counts an error only when a handler raises; the edge answers
its errors from a task, after the handler returned (a served request's, seconds later), so it
keeps that count itself, as Go's ``Request.Error`` does, and adds it to each endpoint's stats.
Only ``infer`` carries the edge's counters as its ``data``: they are about its requests.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import Endpoint, EndpointStats, Service, ServiceConfig, ServiceStats

from edge_node.parts import EdgeCounts, KeptAnswers, Serve
from edge_node.records import (
    SERVICE_ERROR,
    SERVICE_ERROR_CODE,
    NatsSink,
    Record,
    Records,
    error_headers,
)
from mesh import __version__
from mesh.config import EdgeSettings, LimitSettings
from mesh.connection import Connection
from mesh.inline_sub import make_inline
from mesh.logs import get_logger, log_unknown_fields
from mesh.tasks import TaskSet
from mesh.tracing import trace_headers
from mesh.write_batch import room
from protocol.codec import (
    CONTENT_TYPE,
    WireFormat,
    decode_request,
    dump,
    error_event,
    load,
    sniff,
)
from protocol.errors import (
    CancelledByClientError,
    ErrorCode,
    InvalidRequestError,
    MeshError,
    OverloadedError,
    PayloadTooLargeError,
    UnavailableError,
)
from protocol.messages import ErrorEvent
from protocol.subjects import (
    MAX_SUBJECT,
    edge_answer_subject,
    edge_cancel_subject,
    edge_infer_subject,
    edge_resend_subject,
    is_literal,
    is_reply_inbox,
    is_reserved,
    is_token,
    sender_scope,
)

log = get_logger(__name__)


_ENDPOINT_PARTS = ("_num_requests", "_num_errors", "_last_error", "_processing_time")
_SUBSCRIPTION_PARTS = ("_pending_queue", "_stop_processing", "_message_iterator", "_pending_size")
"""The private parts of nats-py's micro endpoint and subscription the read-loop intake uses."""


async def _send_quietly(sink: NatsSink, event: ErrorEvent) -> None:
    with contextlib.suppress(MeshError):
        await sink.send(event)


async def _respond_error(request: Request, exc: Exception) -> None:
    if reply_to(request):
        with contextlib.suppress(nats.errors.Error, ValueError):
            await request.respond_error("500", repr(exc)[:500])


def reply_of(request: Request) -> str:
    """The reply subject of a micro-service request (nats-py keeps it on the private message;
    the edge needs it to know where, and whether, it may answer)."""
    return request._msg.reply or ""


def reply_to(request: Request) -> str:
    """Where a cancel's, a resend's or an ask's answer may go: the reply subject when it is an
    ordinary inbox, else nowhere (""). Only ``infer`` checked it: a client that may publish
    only to its edge's endpoints had the edge answer into the work queue, a cancel or orphan
    subject or the JetStream API, with the edge's rights (review S20a)."""
    reply = reply_of(request)
    return reply if is_reply_inbox(reply) else ""


@dataclass
class EndpointErrors:
    """The typed errors one endpoint answered."""

    count: int = 0
    last: str | None = None

    def sent(self, event: ErrorEvent) -> None:
        headers = error_headers(event)  # as nats-py shows a raised ServiceError: "code:text"
        self.count += 1
        self.last = f"{headers[SERVICE_ERROR_CODE]}:{headers[SERVICE_ERROR]}"


class EdgeService(Service):
    """nats-py's micro service, with the typed errors the edge answered in each endpoint's
    stats."""

    def __init__(self, nc: Client, config: ServiceConfig, errors: dict[str, EndpointErrors]):
        super().__init__(nc, config)
        self.errors = errors

    def stats(self) -> ServiceStats:
        stats = super().stats()
        for endpoint in stats.endpoints:
            errors = self.errors.get(endpoint.name)
            if errors is not None and errors.count:
                endpoint.num_errors += errors.count
                endpoint.last_error = errors.last
        return stats


RESYNC_BEFORE_S = 2.0
"""How long before its link dropped an answer may have ended and still lost its tail (writes
that sat in buffers on the way to the server)."""


@dataclass(frozen=True)
class IntakeParts:
    """What the intake uses of the edge."""

    conn: Connection
    edge_id: str
    edge: EdgeSettings
    limits: LimitSettings
    strict_decode: bool
    counts: EdgeCounts
    records: Records
    tasks: TaskSet
    """Requests in flight: each request is served in a task of its own."""
    serve: Serve
    accepting: Callable[[], bool]
    in_flight: Callable[[], int]
    """The requests the edge is answering, from NATS and HTTP: ``max_concurrent`` bounds them."""
    stats: Callable[[], dict[str, Any]]
    """The edge's counters and budget, the ``data`` of the ``infer`` endpoint's stats."""
    site: KeptAnswers | None


class NatsIntake:
    def __init__(self, parts: IntakeParts) -> None:
        self.parts = parts
        self.errors = {name: EndpointErrors() for name in ("infer", "cancel", "resend", "answer")}
        self.service: EdgeService | None = None
        self._infer: Endpoint | None = None
        """The ``infer`` endpoint, once its requests are taken in the read loop."""
        self._refusals = TaskSet("edge-refusals")
        """Refusals sent from the read loop: apart from the requests (``parts.tasks``), so
        that they neither count toward the concurrency limit nor are cancelled with them."""
        self._asks = TaskSet("edge-answer-asks")
        """Asks for kept answers, each in a task: one slow read of the site's store held up
        every other ask behind it (the endpoint's callbacks run one at a time)."""

    async def start(self, metadata: dict[str, str]) -> EdgeService:
        """The micro service ``mesh-edge`` and its endpoints (``metadata``: the service keeps
        this dict, so ``$SRV.INFO`` shows its updates)."""
        parts = self.parts
        config = ServiceConfig(
            name="mesh-edge",
            version=__version__,
            description="mesh edge node: local inference with cloud escalation",
            metadata=metadata,
            stats_handler=self._stats_data,
        )
        self.service = service = EdgeService(parts.conn.nc, config, self.errors)
        await service.start()
        group = f"mesh-edge-{parts.edge_id}"
        for name, subject, handler in (
            ("infer", edge_infer_subject(parts.edge_id), self.on_request),
            ("cancel", edge_cancel_subject(parts.edge_id), self.on_cancel),
            ("resend", edge_resend_subject(parts.edge_id), self.on_resend),
            ("answer", edge_answer_subject(parts.edge_id), self._on_answer),
        ):
            await service.add_endpoint(
                name=name, subject=subject, handler=handler, queue_group=group
            )
        # Requests are taken in the read loop, not in the subscription's task: one task hop
        # less for each (private parts of nats-py's micro service: where an upgrade moved
        # them, the endpoint keeps its callback; tests/test_operations.py reads its stats).
        infer = next(
            (e for e in getattr(service, "_endpoints", ()) if getattr(e, "_name", "") == "infer"),
            None,
        )
        sub = getattr(infer, "_subscription", None)
        if all(hasattr(infer, name) for name in _ENDPOINT_PARTS) and all(
            hasattr(sub, name) for name in _SUBSCRIPTION_PARTS
        ):
            self._infer = infer
            make_inline(sub, functools.partial(self._on_infer, infer))  # type: ignore[arg-type]
        return service

    async def close(self, timeout: float) -> None:
        """Once the endpoints stopped: the refusals still being sent get ``timeout`` seconds."""
        await self._refusals.close(grace=timeout)
        await self._asks.close(grace=timeout)

    async def resync(self) -> None:
        """After the edge's link came back (a recovery step, :meth:`Connection.on_reconnect`).

        What the edge wrote to its clients' inboxes just before the link dropped may never
        have reached the server, and a lost tail has nothing after it to show a client the
        gap: its reader would wait out a quiet spell (1 s) before asking. So each streaming
        client whose answer was in flight then, or ended shortly before, gets that answer's
        last event again: a duplicate it drops, or the gap it repairs at once (``resend``).
        A requester (``nats req``: one reply) whose answer ended shortly before gets it again:
        it takes the first reply only, and without this it would wait out its timeout."""
        conn = self.parts.conn
        since = (conn.dropped_at or time.monotonic()) - RESYNC_BEFORE_S
        sent = 0
        for record in self.parts.records.since(since):
            last = record.last()
            if last is None:
                continue
            for sink in list(record.sinks):
                if isinstance(sink, NatsSink):
                    with contextlib.suppress(MeshError):
                        await sink.send_again(last)
                        sent += 1
        await conn.nc.flush(timeout=max(1, round(conn.settings.request_timeout)))
        if sent:
            log.info("last events sent again to clients after a reconnect", events=sent)

    def _stats_data(self, endpoint: EndpointStats) -> dict[str, Any] | None:
        return self.parts.stats() if endpoint.name == "infer" else None

    def _sink(self, reply: str, request_id: str, fmt: WireFormat, *, streaming: bool) -> NatsSink:
        """A sink for a request on the ``infer`` endpoint, which counts its error replies."""
        return NatsSink(
            self.parts.conn,
            reply,
            request_id,
            fmt,
            streaming=streaming,
            on_error=self.errors["infer"].sent,
        )

    async def on_request(self, request: Request) -> None:
        """The ``infer`` endpoint's handler as nats-py's micro service calls it (from the
        subscription's task): only until :meth:`start` makes the subscription inline."""
        self.take(request)

    def _on_infer(self, endpoint: Endpoint, msg: Msg) -> None:
        """In the read loop: one message to the ``infer`` endpoint, counted as the micro
        service counts a request."""
        began = time.perf_counter_ns()
        request = Request(msg)
        try:
            self.take(request)
        except Exception as exc:  # answered as nats-py's micro service answers a raising handler
            log.exception("request intake failed", subject=msg.subject)
            endpoint._num_errors += 1
            endpoint._last_error = repr(exc)  # type: ignore[assignment]
            self._refusals.spawn(_respond_error(request, exc), name="edge-intake-failure")
        endpoint._num_requests += 1
        endpoint._processing_time += time.perf_counter_ns() - began
        endpoint._average_processing_time = endpoint._processing_time // endpoint._num_requests

    def take(self, request: Request) -> None:
        """Check what a request may ask, and hand it to a task of its own at once (this runs
        in the connection's read loop)."""
        reply = reply_of(request)
        if not reply:
            log.warning(
                "request without reply subject dropped; use `nats req`", subject=request.subject
            )
            return
        if not is_reply_inbox(reply):
            self.parts.counts.inc("refused.reply")
            if is_reserved(reply) or not is_literal(reply):
                log.warning("refusing to answer into a reserved subject", reply=reply[:200])
                return
            # Only too long: the client listens there, and hears why.
            too_long = f"the reply subject is {len(reply)} characters long; at most {MAX_SUBJECT}"
            loc = [{"loc": "reply", "msg": "too long"}]
            self._refuse(request, reply, InvalidRequestError(too_long, details=loc))
            return
        accepting = self.parts.accepting()
        if not accepting or self.parts.in_flight() >= self.parts.edge.max_concurrent:
            error: MeshError = (
                OverloadedError("edge is at its concurrency limit", retry_after=1.0)
                if accepting  # stopping: as over HTTP (another edge may answer at once)
                else UnavailableError("edge is shutting down", retry_after=1.0)
            )
            self.parts.counts.refused(error)
            self._refuse(request, reply, error)
            return
        self.parts.tasks.spawn(self._serve(request, reply), name="edge-request")

    def _refuse(self, request: Request, reply: str, error: MeshError) -> None:
        """Refuse a request at the door: its error, in its format, sent from a task."""
        fmt = sniff(request.data, request.headers).reply_format
        sink = self._sink(reply, "", fmt, streaming=False)
        self._refusals.spawn(_send_quietly(sink, error_event(error)), name="edge-refusal")

    async def _serve(self, request: Request, reply: str) -> None:
        received = time.perf_counter()
        try:
            req, fmt = decode_request(
                request.data,
                request.headers,
                limits=self.parts.limits.request_limits(),
                strict=self.parts.strict_decode,
                on_unknown=log_unknown_fields,
            )
            if req.deferrable and self.parts.site is None:  # as HTTP refuses `flex`
                raise InvalidRequestError(
                    "deferrable needs an edge at a site with JetStream of its own, which keeps "
                    "the request and its answer; this edge has none: send it without",
                    details=[{"loc": "deferrable", "msg": "needs an edge site"}],
                    request_id=req.id,
                )
        except MeshError as err:
            self.parts.counts.refused(err)
            log.info("request rejected", code=err.code.value, error=err.message)
            fmt = sniff(request.data, request.headers).reply_format
            sink = self._sink(reply, err.request_id or "", fmt, streaming=False)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(err, err.request_id))
            return
        except Exception as exc:  # a defect of this edge's: told, never its sender's silence
            log.exception("reading a request failed", error=repr(exc))
            self._refuse(request, reply, MeshError("the edge failed to read this request"))
            return
        sink = self._sink(reply, req.id, fmt.reply_format, streaming=req.stream)
        await self.parts.serve(
            req,
            sink,
            scope=sender_scope(reply),
            received=received,
            trace=trace_headers(request.headers),
        )

    async def on_cancel(self, request: Request) -> None:
        record, inbox, _ask = self._own_record(request)
        cancelled = record is not None and record.task is not None
        if record is not None and record.task is not None:
            mine = [s for s in record.sinks if getattr(s, "inbox", None) == inbox]
            others = [s for s in record.sinks if getattr(s, "inbox", None) != inbox]
            if others:
                # Another sender of the same request still reads it: only this one leaves.
                log.info("reader of a joined request left", request_id=record.client_id)
                record.sinks[:] = others
                error = CancelledByClientError("cancelled", request_id=record.client_id)
                for sink in mine:
                    with contextlib.suppress(MeshError):
                        await sink.send(error_event(error, record.client_id))
            else:
                log.info("cancel from the client", request_id=record.client_id)
                record.cancelled = True
                record.task.cancel()
        elif record is None and inbox:
            self.parts.counts.inc("refused.cancel")  # not the sender's inbox, or an unknown id
        if reply_to(request):
            with contextlib.suppress(nats.errors.Error, ValueError):
                await request.respond(json.dumps({"cancelled": cancelled}).encode())

    async def _on_answer(self, request: Request) -> None:
        if len(self._asks) >= self.parts.edge.max_concurrent:
            busy = OverloadedError("too many asks for kept answers at once", retry_after=1.0)
            self._refusals.spawn(self._reply(request, error_event(busy)), name="edge-refusal")
            return
        self._asks.spawn(self.on_answer(request), name="edge-answer")

    async def on_answer(self, request: Request) -> None:
        """The kept answer of a request that could wait, by its id: an ``answer``, its typed
        ``err``, or ``unavailable`` while it is not answered yet."""
        outcome: Any = None
        try:
            raw = load(request.data, sniff(request.data, request.headers))
            request_id = raw.get("id") if isinstance(raw, dict) else None
            if not isinstance(request_id, str) or not is_token(request_id):
                raise InvalidRequestError('send {"id": "<request id>"}')
            if self.parts.site is None:
                raise UnavailableError(  # and never will: asking again does not help
                    "this edge keeps no answers (its site has no JetStream)", retryable=False
                )
            key = raw.get("key") if isinstance(raw.get("key"), str) else None
            outcome = await self.parts.site.fetch(request_id, key)
            if outcome is None:
                raise UnavailableError(
                    f"no answer kept for {request_id!r} yet (held at the site, in the cloud, "
                    "or unknown), or not for this key",
                    request_id=request_id,
                    retry_after=30.0,
                )
        except MeshError as err:
            outcome = error_event(err, err.request_id)
        except Exception:  # a bug, or a site store holding what it should not: still answered
            log.exception("ask for a kept answer failed")
            outcome = error_event(MeshError("edge failure", code=ErrorCode.INTERNAL))
        await self._reply(request, outcome)

    async def _reply(self, request: Request, outcome: Any) -> None:
        """An answer-endpoint reply, in the ask's format."""
        fmt = sniff(request.data, request.headers).reply_format
        data, nc = dump(outcome, fmt), self.parts.conn.nc
        if len(data) > room(nc):  # kept in msgpack: it can grow in JSON
            smaller = "" if fmt is WireFormat.MSGPACK else ": ask for it in msgpack (smaller)"
            too_large = PayloadTooLargeError(
                f"the answer is {len(data)} bytes in {fmt.value}, over the {room(nc)} one "
                f"message can carry here{smaller}",
                request_id=outcome.id,
            )
            outcome = error_event(too_large, outcome.id)
            data = dump(outcome, fmt)
        failed = isinstance(outcome, ErrorEvent)
        headers = {CONTENT_TYPE: fmt.content_type, **(error_headers(outcome) if failed else {})}
        if reply := reply_to(request):
            with contextlib.suppress(nats.errors.Error):
                await nc.publish(reply, data, headers=headers)
                if failed:
                    self.errors["answer"].sent(outcome)

    async def on_resend(self, request: Request) -> None:
        record, inbox, raw = self._own_record(request)
        sent = 0
        if record is not None:
            try:  # in the format the ask came in (the SDK asks in msgpack)
                attempt, seq = int(raw.get("attempt", 0)), int(raw.get("seq", 0))
            except (ValueError, TypeError, AttributeError, OverflowError):
                attempt, seq = 0, 0
            sink = next(s for s in record.sinks if getattr(s, "inbox", None) == inbox)
            for event in record.lacking(attempt, seq):
                with contextlib.suppress(MeshError):
                    await sink.send(event)
                    sent += 1
            self.parts.counts.inc("resent", sent)
        if reply_to(request):
            with contextlib.suppress(nats.errors.Error, ValueError):
                await request.respond(
                    json.dumps({"known": record is not None, "events": sent}).encode()
                )

    def _own_record(self, request: Request) -> tuple[Record | None, str, dict[str, Any]]:
        """The record a cancel or resend names, if it names the inbox that made the request;
        the inbox; the ask, read."""
        try:
            raw = load(request.data, sniff(request.data, request.headers))
        except MeshError:
            return None, "", {}
        if not isinstance(raw, dict):
            return None, "", {}
        request_id, inbox = raw.get("id"), raw.get("inbox")
        if not isinstance(request_id, str) or not isinstance(inbox, str):
            return None, "", raw
        record = self.parts.records.get(sender_scope(inbox), request_id)
        if record is None or not any(getattr(s, "inbox", None) == inbox for s in record.sinks):
            return None, inbox, raw
        return record, inbox, raw
