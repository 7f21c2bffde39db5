"""Escalating one request through the JetStream work queue, as the edge and the SDK do.

Order matters: subscribe to ``mesh.v1.tok.<id>`` and flush (the server now knows the
subscription), then publish with ``Nats-Msg-Id = id`` and wait for the publish ack: from then on
the request is durable and a retried publish is dropped as a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping

import nats.errors
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.events import read_events
from mesh.lifecycle import Lifecycle
from mesh.logs import get_logger
from protocol.codec import CONTENT_TYPE, WireFormat, dump
from protocol.errors import MeshTimeoutError, OverloadedError, UnavailableError
from protocol.messages import EndEvent, InferRequest, RestartEvent, TokenEvent
from protocol.subjects import cancel_subject, infer_subject, token_subject

log = get_logger(__name__)

# JetStream error codes for "stream is full" with discard=new.
_STORE_FULL_CODES = {10077, 10078, 10027, 10028}
MSG_ID_HEADER = "Nats-Msg-Id"
CANCELLER_HEADER = "Mesh-Canceller"
"""Who sent a cancel, so a node can ignore the cancels it sent itself."""


TRACE_HEADERS = ("traceparent", "tracestate")
"""W3C trace context: carried from the client's request to the queued one, unchanged."""


def trace_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {k: v for k, v in (headers or {}).items() if k.lower() in TRACE_HEADERS}


async def publish_request(
    conn: Connection,
    stream: StreamSettings,
    request: InferRequest,
    extra_headers: Mapping[str, str] | None = None,
) -> api.PubAck:
    """Publish ``request`` to its model's queue subject; typed errors for every failure."""
    model = request.model
    if model is None:
        raise ValueError("request.model must be set before it is queued")
    headers = {
        **(extra_headers or {}),
        MSG_ID_HEADER: request.id,
        CONTENT_TYPE: WireFormat.MSGPACK.content_type,
    }
    try:
        return await conn.js.publish(
            infer_subject(model),
            dump(request, WireFormat.MSGPACK),
            timeout=conn.settings.request_timeout,
            stream=stream.name,
            headers=headers,
        )
    except APIError as exc:
        if exc.err_code in _STORE_FULL_CODES or "maximum" in (exc.description or ""):
            raise OverloadedError(
                f"the cloud queue is full ({exc.description})",
                retry_after=stream.retry_after,
                request_id=request.id,
            ) from None
        raise UnavailableError(
            f"JetStream refused the request: {exc.description}", request_id=request.id
        ) from None
    except NoStreamResponseError:
        raise UnavailableError(
            f"no JetStream stream answers {infer_subject(model)}: is JetStream enabled and "
            "provisioned (`mesh provision`)?",
            request_id=request.id,
        ) from None
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        raise MeshTimeoutError(
            f"JetStream did not ack the request within {conn.settings.request_timeout:g}s",
            request_id=request.id,
        ) from None
    except (
        nats.errors.ConnectionClosedError,
        nats.errors.OutboundBufferLimitError,
        nats.errors.ConnectionReconnectingError,
    ) as exc:
        raise UnavailableError(
            f"NATS is not connected ({type(exc).__name__})", request_id=request.id
        ) from None


class CloudCall(Lifecycle):
    """One escalated request: ``async with CloudCall(...) as call: async for ev in call.events()``.

    ``events`` turns a change of delivery attempt (a worker died and JetStream redelivered) into
    one :class:`RestartEvent`, so a reader never mixes two generations' text.
    """

    def __init__(
        self,
        conn: Connection,
        stream: StreamSettings,
        request: InferRequest,
        *,
        canceller: str = "client",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.conn = conn
        self.canceller = canceller
        self.headers = dict(headers or {})
        self.stream = stream
        self.request = request.model_copy(update={"reply": token_subject(request.id)})
        self.ack: api.PubAck | None = None
        self._sub: Subscription | None = None

    async def open(self) -> CloudCall:
        nc = self.conn.nc
        self._sub = await nc.subscribe(token_subject(self.request.id))
        try:
            try:
                await nc.flush(timeout=max(1, round(self.conn.settings.request_timeout)))
            except nats.errors.TimeoutError:
                raise MeshTimeoutError("NATS did not confirm the token subscription") from None
            self.ack = await publish_request(self.conn, self.stream, self.request, self.headers)
        except BaseException:
            await self.close()
            raise
        if self.ack.duplicate:
            log.info("request already queued (duplicate publish)", request_id=self.request.id)
        return self

    async def events(
        self, *, first_timeout: float, idle_timeout: float
    ) -> AsyncGenerator[TokenEvent | RestartEvent | EndEvent, None]:
        if self._sub is None:
            raise RuntimeError("CloudCall.open() first")
        attempt = 1
        async for event in read_events(
            self._sub, first_timeout=first_timeout, idle_timeout=idle_timeout, what="the cloud"
        ):
            if isinstance(event, RestartEvent):
                if event.attempt > attempt:
                    attempt = event.attempt
                    yield event
                continue
            if isinstance(event, TokenEvent):
                if event.attempt < attempt:
                    continue  # a late token from an attempt already abandoned
                if event.attempt > attempt:
                    attempt = event.attempt
                    yield RestartEvent(id=event.id, attempt=attempt)
            yield event

    async def withdraw(self) -> None:
        """Take the request back: delete it from the queue if still there, and cancel it."""
        with contextlib.suppress(Exception):
            await self.conn.nc.publish(
                cancel_subject(self.request.id), b"", headers={CANCELLER_HEADER: self.canceller}
            )
        if self.ack is not None:
            # Fails when already delivered (the cancel covers that) or already gone: both fine.
            with contextlib.suppress(APIError, asyncio.TimeoutError, nats.errors.Error):
                await self.conn.jsm().delete_msg(self.ack.stream, self.ack.seq)

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    start = open
    stop = close
