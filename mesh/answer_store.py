"""The answer store: stream ``MESH_TOK`` keeps every request's events a short while.

Workers publish events with a plain (core) publish on ``mesh.v1.tok.<scope>.<id>``; the stream
captures them as they pass, so the hot path waits for nothing. What the store is for:

- a reader that missed events (a dropped connection, a slow consumer, a server restart) reads
  them back by subject instead of ending with a gap (:meth:`TokenStore.replay`);
- a worker that takes over a request after another one died reads how far the answer got and
  continues it from there;
- a worker whose connection dropped mid-answer checks what the store kept and publishes again
  what it lost;
- a request sent again with the same id gets its stored answer.

Reads use batch direct get (``$JS.API.DIRECT.GET``), served by any replica without a consumer.
A sender under ``mesh creds`` permissions may not use direct get (its request body, not its
subject, names what to read, so a server cannot limit it to the sender's own answers): it reads
through a short-lived consumer whose filter, written in the API subject, is its own token subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets

import nats.errors
from nats.js import api
from nats.js.manager import JetStreamManager

from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.logs import get_logger
from mesh.provision import ensure_config, placement
from protocol.codec import decode_event
from protocol.errors import MeshError, MeshTimeoutError, UnavailableError
from protocol.messages import Answer, WireEvent
from protocol.subjects import TOKEN_WILDCARD

log = get_logger(__name__)
BATCH = 1024
"""Messages asked for per direct-get batch (an answer has one per coalesced chunk)."""


def answer_stream_config(settings: StreamSettings) -> api.StreamConfig:
    return api.StreamConfig(
        name=settings.answer_stream,
        description="mesh: recent answer events, for catching up and for continuing an answer",
        subjects=[TOKEN_WILDCARD],
        retention=api.RetentionPolicy.LIMITS,
        storage=(
            api.StorageType.FILE if settings.answer_storage == "file" else api.StorageType.MEMORY
        ),
        max_age=settings.answer_max_age,
        max_bytes=settings.answer_max_bytes,
        discard=api.DiscardPolicy.OLD,
        allow_direct=True,
        duplicate_window=min(1.0, settings.answer_max_age),  # events carry no msg ids
        num_replicas=settings.answer_replicas or settings.replicas,
        placement=placement(settings),
    )


async def ensure_answer_stream(jsm: JetStreamManager, settings: StreamSettings) -> None:
    """Create or update ``MESH_TOK`` (idempotent; a no-op when the store is turned off)."""
    if settings.answer_storage == "off":
        return
    managed = ("subjects", "max_age", "max_bytes", "discard", "allow_direct", "num_replicas")
    await ensure_config(jsm, answer_stream_config(settings), managed)


class AnswerStore:
    """Reads one request's kept events back, in the order the stream stored them."""

    def __init__(
        self, conn: Connection, settings: StreamSettings, *, filtered: bool | None = None
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.enabled = settings.answer_storage != "off"
        self.filtered = conn.settings.least_privilege if filtered is None else filtered
        """Read through a filtered consumer instead of direct get (see the module's note)."""

    async def replay(self, subject: str, timeout: float | None = None) -> list[WireEvent]:
        """Every stored event of one answer, by its token ``subject`` (empty when none are kept
        or the store is off).

        Raises :class:`MeshTimeoutError` or :class:`UnavailableError` when the store cannot be
        read now: a caller cannot tell "nothing kept" from "cannot look".
        """
        if not self.enabled:
            return []
        timeout = self.conn.settings.request_timeout if timeout is None else timeout
        events: list[WireEvent] = []
        fetch = self._fetch_filtered if self.filtered else self._fetch
        try:
            found = await fetch(subject, timeout)
        except nats.errors.ConnectionClosedError:
            raise UnavailableError(
                "NATS connection closed while reading the answer store"
            ) from None
        except nats.errors.Error as exc:  # e.g. the reconnect buffer is full during an outage
            raise UnavailableError(
                f"cannot read the answer store now: {type(exc).__name__}", retry_after=1.0
            ) from None
        for data in found:
            with contextlib.suppress(MeshError):  # a malformed event is dropped, as live
                event = decode_event(data)
                if not isinstance(event, Answer):
                    events.append(event)
        return events

    async def _fetch(self, subject: str, timeout: float) -> list[bytes]:
        nc = self.conn.nc
        inbox = nc.new_inbox()
        try:
            sub = await nc.subscribe(inbox)
        except nats.errors.Error as exc:
            raise UnavailableError(f"cannot read the answer store: {type(exc).__name__}") from None
        found: list[bytes] = []
        seq = 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                request = {"next_by_subj": subject, "seq": seq, "batch": BATCH}
                await nc.publish(
                    f"{self.conn.api_prefix}.DIRECT.GET.{self.settings.answer_stream}",
                    json.dumps(request).encode(),
                    reply=inbox,
                )
                pending = 0
                while True:
                    left = deadline - loop.time()
                    if left <= 0:
                        raise MeshTimeoutError(f"the answer store did not answer in {timeout:g}s")
                    try:
                        msg = await sub.next_msg(timeout=left)
                    except nats.errors.TimeoutError:
                        continue  # the loop head raises once the deadline passed
                    status = (msg.headers or {}).get("Status")
                    if status is None:
                        found.append(msg.data)
                        seq = int((msg.headers or {}).get("Nats-Sequence", seq)) + 1
                        continue
                    if status == "404":
                        return found
                    if status == "204":  # end of this batch
                        pending = int((msg.headers or {}).get("Nats-Num-Pending", "0") or 0)
                        break
                    if status == "503":
                        raise UnavailableError("no responders: the answer store is not there")
                    raise UnavailableError(f"the answer store answered status {status}")
                if pending <= 0:
                    return found
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _fetch_filtered(self, subject: str, timeout: float) -> list[bytes]:
        """Every kept message on ``subject``, pushed by an ephemeral consumer filtered to it."""
        nc = self.conn.nc
        stream = self.settings.answer_stream
        name = f"repair_{secrets.token_hex(8)}"
        inbox = nc.new_inbox()
        config = {
            "name": name,
            "deliver_subject": inbox,
            "filter_subject": subject,
            "deliver_policy": "all",
            "ack_policy": "none",
            "max_ack_pending": 0,
            "inactive_threshold": int(1e9),  # gone a second after this read unsubscribes
            "mem_storage": True,
        }
        body = json.dumps({"stream_name": stream, "config": config, "action": "create"})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            sub = await nc.subscribe(inbox)
        except nats.errors.Error as exc:
            raise UnavailableError(f"cannot read the answer store: {type(exc).__name__}") from None
        try:
            reply = await nc.request(
                f"{self.conn.api_prefix}.CONSUMER.CREATE.{stream}.{name}.{subject}",
                body.encode(),
                timeout,
            )
            info = json.loads(reply.data)
            if "error" in info:
                raise UnavailableError(
                    f"the answer store refused a reader: {info['error'].get('description')}"
                )
            found: list[bytes] = []
            if int(info.get("num_pending", 0)) == 0:
                return found
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise MeshTimeoutError(f"the answer store did not answer in {timeout:g}s")
                msg = await sub.next_msg(timeout=left)
                if (msg.headers or {}).get("Status"):
                    continue  # a heartbeat or flow-control message, not an event
                found.append(msg.data)
                if msg.metadata.num_pending == 0:
                    return found
        except nats.errors.TimeoutError:
            raise MeshTimeoutError(f"the answer store did not answer in {timeout:g}s") from None
        except nats.errors.NoRespondersError:
            raise UnavailableError("no responders: the answer store is not there") from None
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
