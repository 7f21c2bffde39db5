"""One queued copy at a time for a request that can wait.

A request that can wait may sit in the queue twice: its site's forward was written, the ack was
lost, and the retry came after the queue's dedupe window. Both copies carry the same scope and
id, and so the same token subject and the same kept answer; two workers generating them at once
would write two answers into one stream.

So before a worker generates such a request it takes the request's lease: the one message on
``mesh.v1.lease.<scope>.<id>`` in stream ``MESH_LEASES``, which names the queue sequence of the
copy being answered. The lease is written only where the subject's last sequence is the one
the writer expects (JetStream's compare-and-set: 0 creates it), so two workers cannot both
take it. Whoever generates refreshes it with its progress reports; it lapses ``lease_ttl``
after the last one (a worker that died).

- The copy named in the lease (its own redelivery, after its worker died) takes it over and
  continues the answer.
- Any other copy is acked without generating: the copy named in the lease is still in the
  queue (a copy is acked only after its outcome is kept), so that copy ends the request.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

import nats.errors
from nats.js.errors import APIError, NotFoundError

from mesh.connection import Connection
from mesh.logs import get_logger
from protocol.subjects import LEASES_STREAM, lease_subject

log = get_logger(__name__)
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when the subject's last sequence is not the one expected."""
TRIES = 3


class Taken(enum.Enum):
    ELSEWHERE = "another copy of the request holds the lease"


@dataclass
class Lease:
    subject: str
    copy: int
    """The queue sequence of the copy this lease is for."""
    seq: int
    """The lease message's own sequence: the next write expects it."""


class Leases:
    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout

    async def take(self, scope: str, request_id: str, copy: int) -> Lease | Taken | None:
        """The lease for queued copy ``copy`` of the request; ``Taken.ELSEWHERE`` when another
        copy holds it; None when the lease store cannot say (the copy is then answered, as it
        was before leases: a lease store that is down must not stop the answers)."""
        subject = lease_subject(scope, request_id)
        expect = 0
        for _ in range(TRIES):
            seq = await self._write(subject, copy, expect)
            if isinstance(seq, int):
                return Lease(subject, copy, seq)
            if seq is None:
                return None
            try:  # written meanwhile: by whom?
                held = await self.conn.jsm().get_msg(LEASES_STREAM, subject=subject, direct=True)
            except NotFoundError:
                expect = 0  # it lapsed in between
                continue
            except (asyncio.TimeoutError, nats.errors.Error, APIError) as exc:
                log.warning("cannot read a lease", error=repr(exc))
                return None
            if _copy_of(held.data) != copy:
                return Taken.ELSEWHERE
            expect = held.seq or 0  # our own copy, redelivered: take it over
        log.warning("lease contended; answering without one", subject=subject)
        return None

    async def refresh(self, lease: Lease) -> bool:
        """Extend ``lease``; False when it was lost (it lapsed and another copy took it)."""
        seq = await self._write(lease.subject, lease.copy, lease.seq)
        if isinstance(seq, int):
            lease.seq = seq
            return True
        if seq is _CHANGED:
            log.warning("lease lost: it lapsed, or a redelivery took it", subject=lease.subject)
            return False
        return True  # could not tell; the next report tries again

    async def _write(self, subject: str, copy: int, expect: int) -> int | object | None:
        """The new lease message's sequence; ``_CHANGED`` when the subject's last sequence is not
        ``expect``; None when the store did not answer."""
        try:
            ack = await self.conn.js.publish(
                subject,
                str(copy).encode(),
                stream=LEASES_STREAM,
                timeout=self.timeout,
                headers={EXPECTED_LAST: str(expect)},
            )
        except APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return _CHANGED
            log.warning("lease not written", error=repr(exc))
            return None
        except (asyncio.TimeoutError, nats.errors.Error) as exc:
            log.warning("lease not written", error=repr(exc))
            return None
        return int(ack.seq)


_CHANGED = object()


def _copy_of(data: bytes | None) -> int | None:
    try:
        return int((data or b"").decode())
    except ValueError:
        return None
