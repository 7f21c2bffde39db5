"""An edge site's own JetStream: requests that can wait survive an uplink that comes and goes.

The edge daemon talks only to its site's leaf-node nats-server, which runs JetStream of its own
(domain = the site). For a ``deferrable`` request routed to the cloud:

1. ``hold``: the request goes into the site's stream ``MESH_OUTBOX`` (file, message id = the
   request id); once that write is acked the request survives the daemon, the leaf and the link.
2. The *forwarder* (:mod:`edge_node.site_links`) takes the outbox one request at a time, in
   order, and publishes each to the hub's work queue through the leaf link (message id
   ``<scope>.<id>``: the hub drops a repeat). Only after the hub's ack does it ack the outbox
   copy; while the uplink is down it keeps the request and tries again.
3. The worker keeps the whole answer in the hub's ``MESH_ANSWERS`` before it acks the request.
4. The *collector* reads the site's answers through a durable hub consumer filtered to its own
   scope (a worker creates it before keeping the scope's first answer), writes each into the
   site's ``MESH_KEPT`` (message id = the request id), and only then
   acks it on the hub. A flap at any point means a retry, never a loss or a second copy.
5. The client's request waits for its answer in ``MESH_KEPT`` until its deadline; past that (or
   after a disconnect) it asks again by id (``mesh.v1.edge.<edge>.answer``). The deadline bounds
   the holding too: a site whose JetStream stops answering ends the request at its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.js.errors import APIError, NotFoundError

from edge_node.lanes import app_key, key_hash, lane_secret
from edge_node.records import Record
from edge_node.site_answers import Found, emit_outcome, found_in
from edge_node.site_links import (
    HELD_ID_HEADER,
    SITE_STREAMS,
    SiteLinks,
    SiteParts,
    with_site_streams,
)
from mesh import kept
from mesh.js_refused import no_room
from mesh.logs import get_logger
from mesh.provision import provisioned
from mesh.queue import MSG_ID_HEADER
from mesh.tasks import by_deadline, first_of, raise_if_cancelled
from protocol.codec import (
    CONTENT_TYPE,
    WireFormat,
    dump,
)
from protocol.errors import (
    DeadlineExceededError,
    DuplicateRequestError,
    MeshError,
    UnavailableError,
    UnknownModelError,
)
from protocol.fingerprint import request_fingerprint
from protocol.messages import (
    Answer,
    ErrorEvent,
    InferRequest,
    RouteDecision,
)
from protocol.subjects import (
    CLAIMS_STREAM,
    KEPT_STREAM,
    OUTBOX_STREAM,
    claim_subject,
    kept_subject,
    outbox_subject,
)

log = get_logger(__name__)
SERVED_CHECK_S = 1.0
"""How long a request that can wait waits to learn whether its model has a pool at all."""
OUTBOX_FULL_RETRY_S = 5.0
"""Seconds suggested to a client whose request found the site's outbox full."""


class SiteStore:
    def __init__(self, parts: SiteParts) -> None:
        self.parts = parts
        self.conn = parts.conn
        self.scope = parts.scope
        self.links = SiteLinks(parts)
        """The forwarder and the collector."""
        self._lane_secret = lane_secret(parts.creds_file)
        self._undo_reconnect: Callable[[], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self._provision()
        self._undo_reconnect = self.conn.on_reconnect(SITE_STREAMS, self._provision)
        await self.links.start()

    async def _provision(self) -> None:
        """The site's streams and the outbox's forwarder (idempotent): at the start, after every
        reconnect (a leaf restarted on an empty store), and when the forwarder finds them gone
        (:data:`SITE_STREAMS`, the connection's recovery step)."""
        jsm = self.conn.site_jsm()
        stream = self.parts.stream
        for config in (
            kept.outbox_config(stream),
            kept.kept_config(stream),
            kept.claims_config(stream),
        ):
            await provisioned(functools.partial(kept.ensure, jsm, config))
        await self.links.ensure_forwarder()

    async def stop(self) -> None:
        if self._undo_reconnect is not None:
            self._undo_reconnect()
            self._undo_reconnect = None
        await self.links.stop()

    async def held(self) -> int:
        """Requests waiting in the outbox for the uplink."""
        info = await self.conn.site_jsm().stream_info(OUTBOX_STREAM)
        return int(info.state.messages)

    # -- a request ---------------------------------------------------------------------------
    async def relay(self, req: InferRequest, decision: RouteDecision, record: Record) -> None:
        """Hold ``req``, then pass its kept answer on when it comes (or a typed error saying it
        is still held when the client's wait ends first). The request's deadline bounds every
        read and write of the site's JetStream here, not only the wait: a site that stopped
        answering ends the request at its deadline, not each read's timeout later."""
        es = self.parts.edge
        model = req.model or es.cloud_model
        queued = req.model_copy(
            update={
                "model": model,
                "origin": self.parts.edge_id,
                "routing": decision,
                "reply": None,
                "stream": True,
                "cancel_key": None,
                "start_by": None,
            }
        )
        wait_until = req.deadline if req.deadline is not None else time.time() + es.request_timeout
        fingerprint = request_fingerprint(queued)
        record.deferred = True
        sub = await self.conn.nc.subscribe(kept_subject(req.id))
        try:
            found = await by_deadline(
                wait_until, self._held_or_kept(queued, fingerprint, req, record)
            )
            if found is None:
                found = await self._wait(sub, wait_until, req.id)
        except asyncio.TimeoutError:
            raise_if_cancelled()
            self._ended_while_held(req, fingerprint, record)
            raise wait_ended(req, held=record.held) from None
        except asyncio.CancelledError:
            self._ended_while_held(req, fingerprint, record)
            raise
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        outcome, kept_for = found if found is not None else (None, None)
        if kept_for is not None and kept_for != fingerprint:
            raise DuplicateRequestError(
                f"request id {req.id!r} is in use at this site by a different request",
                request_id=req.id,
            )
        if outcome is None:
            raise wait_ended(req, held=True)
        try:
            claimed = await by_deadline(
                wait_until, self._claimed(req.id, fingerprint, req.cancel_key, unclaimed=True)
            )
        except asyncio.TimeoutError:
            raise_if_cancelled()
            raise UnavailableError(
                "the answer is kept at the edge site but its claim could not be read before the "
                "deadline; ask again later by id",
                request_id=req.id,
                retry_after=1.0,
            ) from None
        if not claimed:
            # Kept for another sender (another app, another client's key) asking the same.
            raise DuplicateRequestError(
                f"request id {req.id!r} is in use at this site by another sender",
                request_id=req.id,
            )
        await emit_outcome(record, outcome)

    def _ended_while_held(self, req: InferRequest, fingerprint: str, record: Record) -> None:
        """A held request whose deadline passed at the edge: ``deadline_exceeded`` is kept as
        its answer, for its client asking by id (whatever is held ahead of it), and the
        forwarder does not send it. An answer kept before stays. A cancel is not kept so: the
        same request sent again would be told ``cancelled`` (the site, the hub and the
        collector each drop a repeat under its id), so the held copy is answered all the same."""
        if record.held and req.deadline is not None and time.time() >= req.deadline:
            late = DeadlineExceededError("the request's deadline passed while held")
            self.links.keep_error_soon(req.id, fingerprint, late)

    async def _held_or_kept(
        self, queued: InferRequest, fingerprint: str, req: InferRequest, record: Record
    ) -> Found | None:
        """The answer kept already, or None once ``queued`` is held (``record.held`` then)."""
        model = queued.model or ""
        try:
            served = await asyncio.wait_for(self.parts.models.deployed(model), SERVED_CHECK_S)
        except asyncio.TimeoutError:
            raise_if_cancelled()
            served = True  # the hub is out of reach: hold it (an unknown model ends at deadline)
        if not served:
            raise UnknownModelError(f"no worker pool serves {model!r}", request_id=req.id)
        found = await self.kept_with_fingerprint(req.id)
        if found is None:
            await self.hold(queued, model, fingerprint, claim_key=req.cancel_key, record=record)
        return found

    async def hold(
        self,
        req: InferRequest,
        model: str,
        fingerprint: str,
        *,
        claim_key: str | None = None,
        record: Record | None = None,
    ) -> None:
        """Into the outbox, once per (id, content): the same request sent again is held once;
        another under its id is held too, and told ``duplicate`` when the first one's answer
        comes. Its claim is written first, so that nothing is ever held without one (a claim
        whose hold then failed stays: the same request sent again is held under it). ``record``
        is marked held once the outbox has it."""
        claim = json.dumps({"fp": fingerprint, "key": key_hash(claim_key)}).encode()
        try:
            await with_site_streams(
                self.conn,
                lambda: self.conn.publish_acked(claim_subject(req.id), claim, stream=CLAIMS_STREAM),
            )
        except APIError as exc:
            if "per subject" not in str(exc.description or "").lower():
                raise UnavailableError(  # the store refused it (full, or otherwise): not held
                    f"the site could not hold the request (its claim was refused: "
                    f"{exc.description}); send it again",
                    request_id=req.id,
                    retry_after=1.0,
                ) from None
            # claimed before under this id: the first claim stays
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(
                f"the site could not hold the request (its claim was not written: "
                f"{type(exc).__name__}); send it again",
                request_id=req.id,
                retry_after=1.0,
            ) from None
        held = dump(req, WireFormat.MSGPACK)
        headers = {
            MSG_ID_HEADER: f"{req.id}.{fingerprint}",
            HELD_ID_HEADER: req.id,
            CONTENT_TYPE: WireFormat.MSGPACK.content_type,
        }
        try:
            ack = await with_site_streams(
                self.conn,
                lambda: self.conn.publish_acked(
                    outbox_subject(model, self.scope), held, stream=OUTBOX_STREAM, headers=headers
                ),
            )
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            hint = ": requests wait there while the hub cannot take them"
            full = isinstance(exc, APIError) and no_room(
                exc, "the site's outbox", OUTBOX_FULL_RETRY_S, req.id, hint
            )
            if full:  # as the hub's full queue says it
                raise full from None
            why = exc.description if isinstance(exc, APIError) else type(exc).__name__
            raise UnavailableError(
                f"the site could not hold the request: {why}",
                request_id=req.id,
                retry_after=1.0,
            ) from None
        if record is not None:
            record.held = True
        log.info("request held at the site", request_id=req.id, duplicate=ack.duplicate)

    async def kept(self, request_id: str) -> Answer | ErrorEvent | None:
        """The kept answer of ``request_id`` at this site, if it came."""
        found = await self.kept_with_fingerprint(request_id)
        return found[0] if found is not None else None

    async def fetch(self, request_id: str, key: str | None) -> Answer | ErrorEvent | None:
        """The kept answer of ``request_id`` for whoever asks with the key its request carried
        (``cancel_key``); None for anyone else, as for an answer not come yet. A request held
        without a key can be fetched by anyone at the site."""
        found = await self.kept_with_fingerprint(request_id)
        if found is None:
            return None
        outcome, fingerprint = found
        return outcome if await self._claimed(request_id, fingerprint, key) else None

    async def _claimed(
        self,
        request_id: str,
        fingerprint: str | None,
        key: str | None,
        *,
        unclaimed: bool = False,
    ) -> bool:
        """Whether the kept answer of ``request_id`` (for the request ``fingerprint`` names) is
        for whoever holds ``key``: the key its request was held with, if it had one. A kept
        answer without a claim (its claim lost with the claims' stream) is no one's to fetch by
        id, and only ``unclaimed`` (the request's own sender, waiting with the same content)
        gets it: before, anyone at the site who knew the id did."""
        try:
            msg = await with_site_streams(
                self.conn,
                lambda: self.conn.site_jsm().get_msg(
                    CLAIMS_STREAM, subject=claim_subject(request_id), direct=True
                ),
            )
            claim = json.loads(msg.data or b"{}")
        except NotFoundError:
            return unclaimed
        except (APIError, asyncio.TimeoutError, nats.errors.Error, ValueError) as exc:
            raise UnavailableError(f"the site's claims cannot be read: {exc!r}") from None
        if not isinstance(claim, dict) or claim.get("fp") != fingerprint:
            return False  # kept for another request under this id
        return not claim.get("key") or hmac.compare_digest(claim["key"], key_hash(key))

    def app_key(self, app: str) -> str:
        """The key of an HTTP app's requests here (see :func:`app_key`)."""
        return app_key(self._lane_secret, app)

    async def kept_with_fingerprint(self, request_id: str) -> Found | None:
        """The answer kept for ``request_id``, if any."""
        try:
            msg = await with_site_streams(
                self.conn,
                lambda: self.conn.site_jsm().get_msg(
                    KEPT_STREAM, subject=kept_subject(request_id), direct=True
                ),
            )
        except NotFoundError:
            return None
        except (APIError, asyncio.TimeoutError, nats.errors.Error) as exc:
            raise UnavailableError(f"the site's answers cannot be read: {exc!r}") from None
        return found_in(msg.data or b"", msg.headers)

    async def _wait(self, sub: Any, until: float, request_id: str) -> Found | None:
        """The kept answer, as it comes; after a loss on the link, once read from the site's
        store too: one kept meanwhile (by another replica of this edge) came to nobody here."""
        lost = asyncio.Event()
        undo = self.conn.on_loss(lost.set)
        try:
            while (left := until - time.time()) > 0:
                if lost.is_set():
                    lost.clear()
                    with contextlib.suppress(UnavailableError):  # the link is down again
                        if (found := await self.kept_with_fingerprint(request_id)) is not None:
                            return found
                try:
                    came, msg = await first_of(sub.next_msg(timeout=left), lost, left)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                if came:
                    return found_in(msg.data, msg.headers)
            return None
        finally:
            undo()


def wait_ended(req: InferRequest, *, held: bool) -> MeshError:
    """What the client of a request that can wait hears when its wait ends first. When that was
    the request's own deadline, it is over: no worker starts a request past its deadline, nor
    goes on with one. Else (the edge's timeout, over HTTP) it asks again by id, or sends it again
    when the site may not hold it (a hold cut short may still have landed: sent again, the same
    request is held once)."""
    if req.deadline is not None:
        return DeadlineExceededError(
            "the request's deadline passed before its answer came"
            + (" (held at the edge site)" if held else ""),
            request_id=req.id,
        )
    if held:
        return UnavailableError(
            "held at the edge site until the cloud answers (the uplink may be down); ask again "
            "later by id",
            request_id=req.id,
            retry_after=30.0,
        )
    return UnavailableError(
        "the edge site did not hold the request in time (its JetStream did not answer); send "
        "it again",
        request_id=req.id,
        retry_after=1.0,
    )
