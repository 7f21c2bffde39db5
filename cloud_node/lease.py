"""One queued copy at a time for a request that can wait.

A request that can wait may sit in the queue twice: its site's forward was written, the ack was
lost, and the retry came after the queue's dedupe window. Both copies carry the same scope and
id, and so the same token subject and the same kept answer; two workers generating them at once
would write two answers into one stream.

So before a worker generates such a request it takes the request's lease: the one message on
``mesh.v1.lease.<scope>.<id>`` in stream ``MESH_LEASES``, which names the queue sequence of the
copy being answered and the request's fingerprint. The lease is written only where the
subject's last sequence is the one the writer expects (JetStream's compare-and-set: 0 creates
it), so two workers cannot both take it. Whoever generates refreshes it with its progress
reports; it lapses ``lease_ttl`` after the last one (a worker that died).

- The copy named in the lease (its own redelivery, after its worker died) takes it over and
  continues the answer.
- Another copy of the same request is acked without generating while the copy named in the
  lease is still queued: that copy ends the request. When the named copy has left the queue
  with nothing kept (rejected, or cancelled), the lease is taken over and this copy is served.
- The lease never stops an answer: a lease store that does not answer within a fraction of
  ``ack_wait`` is passed by, and left alone for a lease's lifetime, and the copy is served as
  it was before leases.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from mesh.connection import Connection
from mesh.logs import get_logger
from protocol.errors import MeshError
from protocol.subjects import LEASES_STREAM, lease_subject

log = get_logger(__name__)
RESTORE_FIRST_S = 0.5
RESTORE_MAX_S = 2.0
"""Backoff of :meth:`Leases.restore`: its first pause, and its longest."""
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when the subject's last sequence is not the one expected."""
TRIES = 3
CHANGED = object()
"""A compare-and-set write found another sequence than it expected."""


@dataclass
class Lease:
    subject: str
    copy: int
    """The queue sequence of the copy this lease is for."""
    fingerprint: str
    seq: int
    """The lease message's own sequence: the next write expects it."""


@dataclass
class Held:
    """Another copy of the same request holds the lease."""

    subject: str
    copy: int
    seq: int


OTHER_COPY = "other copy"
"""What :meth:`Leases.claim` says when another queued copy of the request is answered."""
Claim = Callable[[int, str], Awaitable[Lease | str | None]]
"""Take a request's lease for (queued copy, fingerprint): :meth:`Leases.claim`, bound to one
request."""


class Leases:
    def __init__(self, conn: Connection, queue: str, *, timeout: float, ttl: float) -> None:
        self.conn = conn
        self.queue = queue
        """The work-queue stream the copies are queued in."""
        self.timeout = timeout
        """Per lease call: short, so that a slow store never holds up progress reports."""
        self.ttl = ttl
        self.enabled = True
        self._off_until = 0.0
        self.on_lost: Callable[[str], None] | None = None
        """Told when a write finds no lease stream (deleted under the worker): the worker puts
        it back now, rather than every lease being skipped for good while its status says
        leases are on."""

    async def restore(self, ensure: Callable[[], Awaitable[None]]) -> None:
        """The lease stream could not be had when the hub was provisioned (an election,
        JetStream slow or not answering yet, or credentials that do not allow it): requests
        that can wait are served without leases meanwhile. ``ensure()`` (idempotent) is asked
        again, with backoff, until the stream is in place; then leases are on again."""
        pause = RESTORE_FIRST_S
        while not self.enabled:
            await asyncio.sleep(pause)
            try:
                await ensure()
            except (MeshError, nats.errors.Error, APIError, asyncio.TimeoutError) as exc:
                log.debug("lease stream still unavailable", error=repr(exc))
                pause = min(pause * 2, RESTORE_MAX_S)
            else:
                self.enabled = True
                log.info("lease stream in place: requests that can wait have leases again")

    def _available(self) -> bool:
        return self.enabled and time.monotonic() >= self._off_until

    def _trouble(self, what: str, exc: BaseException) -> None:
        """The store did not answer: leave it alone for a lease's lifetime."""
        log.warning(what, error=repr(exc), pause_s=self.ttl)
        self._off_until = time.monotonic() + self.ttl

    async def claim(
        self,
        scope: str,
        request_id: str,
        copy: int,
        fingerprint: str,
        already_kept: Callable[[], Awaitable[bool]],
    ) -> Lease | str | None:
        """The lease for queued copy ``copy``; ``OTHER_COPY`` when another copy is being
        answered, or its answer is kept (ack this one); None to serve this copy without a lease
        (the store cannot say, or another request holds the id)."""
        for _ in range(TRIES):
            taken = await self.take(scope, request_id, copy, fingerprint)
            if not isinstance(taken, Held):
                return taken
            queued = await self._queued(taken.copy)
            if queued is None:
                return None
            if queued or await already_kept():
                return OTHER_COPY
            log.info("the copy holding the lease left the queue unanswered; taking it over")
            lease = await self.take_over(taken, copy, fingerprint)
            if lease is not None:
                return lease
        return None

    async def _queued(self, copy: int) -> bool | None:
        """Whether queued copy ``copy`` is still in the queue (None: cannot tell)."""
        try:
            await asyncio.wait_for(self.conn.jsm().get_msg(self.queue, copy), self.timeout)
        except NotFoundError:
            return False
        except (asyncio.TimeoutError, nats.errors.Error, APIError) as exc:
            log.warning("cannot look up the copy holding a lease", error=repr(exc))
            return None
        return True

    async def take(
        self, scope: str, request_id: str, copy: int, fingerprint: str
    ) -> Lease | Held | None:
        """The lease for queued copy ``copy``; :class:`Held` when another copy of the same
        request holds it; None when the store cannot say, or the holder is another request
        under the same id (the answer store's duplicate check handles that one)."""
        if not self._available():
            return None
        subject = lease_subject(scope, request_id)
        expect = 0
        for _ in range(TRIES):
            written = await self._write(subject, copy, fingerprint, expect)
            if written is None:
                return None
            if written is not CHANGED:
                return Lease(subject, copy, fingerprint, written)
            try:  # written meanwhile: by whom?
                held = await asyncio.wait_for(
                    self.conn.jsm().get_msg(LEASES_STREAM, subject=subject, direct=True),
                    self.timeout,
                )
            except NotFoundError:
                expect = 0  # it lapsed in between
                continue
            except (asyncio.TimeoutError, nats.errors.Error, APIError) as exc:
                self._trouble("cannot read a lease", exc)
                return None
            holder, holder_print = _parse(held.data)
            if holder_print != fingerprint:
                return None
            if holder != copy:
                return Held(subject, holder if holder is not None else -1, held.seq or 0)
            expect = held.seq or 0  # our own copy, redelivered: take it over
        log.warning("lease contended; answering without one", subject=subject)
        return None

    async def take_over(self, held: Held, copy: int, fingerprint: str) -> Lease | None:
        """Take a lease whose copy has left the queue; None when it changed meanwhile."""
        written = await self._write(held.subject, copy, fingerprint, held.seq)
        if written is None or written is CHANGED:
            return None
        return Lease(held.subject, copy, fingerprint, written)

    async def refresh(self, lease: Lease) -> bool:
        """Extend ``lease``; False when it was lost (it lapsed, or was taken over). Tried at each
        report even while new claims keep away from a store that did not answer: a lease not
        refreshed lapses, and another copy of its request may take it."""
        if not self.enabled:
            return True
        written = await self._write(lease.subject, lease.copy, lease.fingerprint, lease.seq)
        if written is CHANGED:
            return False
        if written is not None:  # None: could not tell; a later report tries again
            lease.seq = written
        return True

    async def _write(self, subject: str, copy: int, fingerprint: str, expect: int) -> Any:
        """The new lease message's sequence (an int); ``CHANGED`` when the subject's last
        sequence is not ``expect``; None when the store did not answer."""
        try:
            ack = await self.conn.publish_acked(
                subject,
                f"{copy} {fingerprint}".encode(),
                stream=LEASES_STREAM,
                timeout=self.timeout,
                headers={EXPECTED_LAST: str(expect)},
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return CHANGED
            self._trouble("lease not written", exc)
            return None
        except NoStreamResponseError:
            log.warning("lease not written: the lease stream is gone; putting it back")
            if self.on_lost is not None:
                self.on_lost(f"{LEASES_STREAM} is gone")
            return None  # served without a lease meanwhile; the next claim tries again
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            self._trouble("lease not written", exc)
            return None
        return int(ack.seq)


class Holding:
    """The lease of the copy being answered (None: served without one), renewed with its
    progress reports (:mod:`cloud_node.progress`)."""

    def __init__(self, leases: Leases, lease: Lease | None, claim: Claim) -> None:
        self.leases = leases
        self.lease = lease
        self.claim = claim

    async def renew(self) -> bool:
        """Refresh the lease; when it was lost, claim it again. False when another copy of the
        request is answered now: this copy is handed back."""
        if self.lease is None:
            return True
        if await self.leases.refresh(self.lease):
            return True
        claimed = await self.claim(self.lease.copy, self.lease.fingerprint)
        if claimed == OTHER_COPY:
            log.warning("lease lost to another copy; handing this one back")
            return False
        self.lease = claimed if isinstance(claimed, Lease) else None
        return True


def _parse(data: bytes | None) -> tuple[int | None, str]:
    copy, _, fingerprint = (data or b"").decode(errors="replace").partition(" ")
    try:
        return int(copy), fingerprint
    except ValueError:
        return None, fingerprint
