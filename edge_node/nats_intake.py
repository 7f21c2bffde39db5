"""The edge's NATS micro-service endpoints: requests, cancels, resends and kept answers.

Each handler checks what a client may ask (its own reply inbox, its own records) and hands the
request to :meth:`EdgeNode.serve`; it returns at once, since nats-py runs one subscription's
callbacks one at a time.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.micro.request import Request

from edge_node.records import NatsSink, Record
from mesh.logs import get_logger, log_unknown_fields
from mesh.queue import trace_headers
from protocol.codec import CONTENT_TYPE, decode_request, dump, error_event, load, sniff
from protocol.errors import (
    CancelledByClientError,
    InvalidRequestError,
    MeshError,
    OverloadedError,
    UnavailableError,
)
from protocol.subjects import is_reply_inbox, is_token, sender_scope

if TYPE_CHECKING:
    from edge_node.node import EdgeNode

log = get_logger(__name__)


def reply_of(request: Request) -> str:
    """The reply subject of a micro-service request (nats-py keeps it on the private message;
    the edge needs it to know where, and whether, it may answer)."""
    return request._msg.reply or ""


class NatsIntake:
    def __init__(self, node: EdgeNode) -> None:
        self.node = node

    async def on_request(self, request: Request) -> None:
        # nats-py runs one subscription's callbacks one at a time: hand off, return at once.
        reply = reply_of(request)
        if not reply:
            log.warning(
                "request without reply subject dropped; use `nats req`", subject=request.subject
            )
            return
        if not is_reply_inbox(reply):
            self.node.metrics.inc("refused.reply")
            log.warning("refusing to answer into a reserved subject", reply=reply[:200])
            return
        fmt = sniff(request.data, request.headers).reply_format
        if (
            not self.node.accepting
            or len(self.node.tasks) >= self.node.settings.edge.max_concurrent
        ):
            self.node.metrics.inc("error.overloaded")
            reason = (
                "edge is at its concurrency limit" if self.node.accepting else "edge is stopping"
            )
            sink = NatsSink(self.node.conn, reply, "", fmt, streaming=False)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(OverloadedError(reason, retry_after=1.0)))
            return
        self.node.tasks.spawn(self._serve(request, reply), name="edge-request")

    async def _serve(self, request: Request, reply: str) -> None:
        received = time.perf_counter()
        try:
            req, fmt = decode_request(
                request.data,
                request.headers,
                limits=self.node.settings.limits.request_limits(),
                strict=self.node.settings.strict_decode,
                on_unknown=log_unknown_fields,
            )
        except MeshError as err:
            self.node.metrics.inc(f"error.{err.code.value}")
            log.info("request rejected", code=err.code.value, error=err.message)
            fmt = sniff(request.data, request.headers).reply_format
            sink = NatsSink(self.node.conn, reply, err.request_id or "", fmt, streaming=False)
            with contextlib.suppress(MeshError):
                await sink.send(error_event(err, err.request_id))
            return
        sink = NatsSink(self.node.conn, reply, req.id, fmt.reply_format, streaming=req.stream)
        await self.node.serve(
            req,
            sink,
            scope=sender_scope(reply),
            received=received,
            trace=trace_headers(request.headers),
        )

    async def on_cancel(self, request: Request) -> None:
        record, inbox = self._own_record(request)
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
                record.task.cancel()
        elif record is None and inbox:
            self.node.metrics.inc("refused.cancel")  # not the sender's inbox, or an unknown id
        if reply_of(request):
            with contextlib.suppress(nats.errors.Error, ValueError):
                await request.respond(json.dumps({"cancelled": cancelled}).encode())

    async def on_answer(self, request: Request) -> None:
        """The kept answer of a request that could wait, by its id: an ``answer``, its typed
        ``err``, or ``unavailable`` while it is not answered yet."""
        fmt = sniff(request.data, request.headers).reply_format
        outcome: Any = None
        try:
            raw = load(request.data, sniff(request.data, request.headers))
            request_id = raw.get("id") if isinstance(raw, dict) else None
            if not isinstance(request_id, str) or not is_token(request_id):
                raise InvalidRequestError('send {"id": "<request id>"}')
            if self.node.site is None:
                raise UnavailableError("this edge keeps no answers (its site has no JetStream)")
            key = raw.get("key") if isinstance(raw.get("key"), str) else None
            outcome = await self.node.site.fetch(request_id, key)
            if outcome is None:
                raise UnavailableError(
                    f"no answer kept for {request_id!r} yet (held at the site, in the cloud, "
                    "or unknown), or not for this key",
                    request_id=request_id,
                    retry_after=30.0,
                )
        except MeshError as err:
            outcome = error_event(err, err.request_id)
        if reply_of(request):
            with contextlib.suppress(nats.errors.Error):
                await self.node.conn.nc.publish(
                    reply_of(request), dump(outcome, fmt), headers={CONTENT_TYPE: fmt.content_type}
                )

    async def on_resend(self, request: Request) -> None:
        record, inbox = self._own_record(request)
        sent = 0
        if record is not None:
            try:
                raw = json.loads(request.data or b"{}")
                attempt, seq = int(raw.get("attempt", 0)), int(raw.get("seq", 0))
            except (ValueError, TypeError, AttributeError, OverflowError):
                attempt, seq = 0, 0
            sink = next(s for s in record.sinks if getattr(s, "inbox", None) == inbox)
            for event in record.lacking(attempt, seq):
                with contextlib.suppress(MeshError):
                    await sink.send(event)
                    sent += 1
            self.node.metrics.inc("resent", sent)
        if reply_of(request):
            with contextlib.suppress(nats.errors.Error, ValueError):
                await request.respond(
                    json.dumps({"known": record is not None, "events": sent}).encode()
                )

    def _own_record(self, request: Request) -> tuple[Record | None, str]:
        """The record a cancel or resend names, if it names the inbox that made the request."""
        try:
            raw = load(request.data, sniff(request.data, request.headers))
        except MeshError:
            return None, ""
        if not isinstance(raw, dict):
            return None, ""
        request_id, inbox = raw.get("id"), raw.get("inbox")
        if not isinstance(request_id, str) or not isinstance(inbox, str):
            return None, ""
        record = self.node.records.get(sender_scope(inbox), request_id)
        if record is None or not any(getattr(s, "inbox", None) == inbox for s in record.sinks):
            return None, inbox
        return record, inbox
