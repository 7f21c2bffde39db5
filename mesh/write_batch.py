"""Answer messages that may wait a moment, written to the socket together.

nats-py writes whatever is pending each time its flusher task gets the loop. A worker streaming
several answers hands the loop between its tasks so often that nearly every token message went
out in a write of its own: a system call here, and a read and a wakeup in the server and in every
reader downstream (``mesh bench relay``: 4 streams x 4,000 tokens, 16 tokens a message).

A :class:`WriteBatch` holds such messages and publishes them in one burst, so that nats-py writes
them in one go:

- after a quiet spell (nothing written for ``gap`` seconds) a message goes as soon as the loop
  comes round, as it did without the write batch;
- a busy write batch writes at most once per ``gap``, each write taking everything queued;
- ``now=True`` (an answer's first events) never waits for the gap: time to first token is not
  traded for throughput.

Order is kept: messages go out in the order they were put, and a caller that publishes something
itself afterwards on the same subject (an answer's end) calls :meth:`flush` first.

A burst is handed to nats-py from the timer's callback itself, not from a task started for it:
one task less per write (the worker's CPU per token, one mesh, A/B: 60.2 -> 56.6 us). A message
without headers (every token) goes in as the protocol line nats-py would write for it, built
here (:func:`_frame`), and the burst is written to the socket there and then
(:func:`mesh.write_now.write_queued`): nats-py's ``publish`` per message (a coroutine, its
checks, a future and a wakeup of its flusher task per burst) cost more than the rest of a
relayed token's way through an edge. nats-py's own checks are kept: the connection's state
once per burst, and per message its subject (no blank or line break) and size; a message that
fails them, and any message with headers, goes through ``publish`` as before, in its place.
"""

from __future__ import annotations

import asyncio
import re

import nats.errors
from nats.aio.client import Client

from mesh.logs import get_logger
from mesh.write_now import write_queued
from protocol.codec import CONTENT_TYPE, WireFormat
from protocol.errors import ErrorCode, MeshError

log = get_logger(__name__)

Headers = dict[str, str] | bytes
"""A message's headers: a dict, or the header block :func:`header_block` made of one (a sender
whose headers never change makes it once)."""
Message = tuple[str, bytes, Headers | None]
MAX_DROPPED = 1024
_ONE_MESSAGE = (
    nats.errors.MaxPayloadError,
    nats.errors.BadSubjectError,
    nats.errors.BadHeaderError,
)
"""Publish errors about one message, not the connection: the rest of a burst still goes."""
SOURCE_GAP_MS = 4.0
"""The gap of a connection that publishes answers as their engines make them (a worker's).
Its tokens come from many streams, each in a loop turn of its own; 4 ms instead of 1 took a
fifth to a third off what a token costs the edge, the SDK and nats-server downstream, at 32
streams (``docs/performance.md``). It is under the worker's coalescing linger (5 ms), so one
stream alone does not wait for it."""
RELAY_GAP_MS = 1.0
"""The gap of any other connection. An edge relays its reads: what one read brings goes out in
one write anyway, and a longer gap there only delayed tokens (same runs)."""


def gap_s(configured_ms: float | None, *, source: bool) -> float:
    """The write gap in seconds: ``configured_ms`` (``MESH_NATS_WRITE_GAP_MS``) when set, else
    :data:`SOURCE_GAP_MS` for a ``source`` connection and :data:`RELAY_GAP_MS` for another."""
    if configured_ms is None:
        configured_ms = SOURCE_GAP_MS if source else RELAY_GAP_MS
    return configured_ms / 1000


class WriteBatch:
    """Publishes on ``client``; ``gap`` seconds: the shortest time between two writes while
    busy (0: every message goes when the loop comes round)."""

    def __init__(self, client: Client, gap: float) -> None:
        self.client = client
        self.gap = max(0.0, gap)
        self._queued: list[Message] = []
        self._scheduled: asyncio.TimerHandle | asyncio.Handle | None = None
        self._urgent = False
        self._last = float("-inf")
        self._dropped: dict[str, str] = {}  # subject -> why a message of it was dropped
        self.failures = 0
        """Bursts that could not be published in full. A publisher that compares this before
        and after its answer knows whether to check what reached the server."""
        self.writes = 0
        """Bursts published (each is one write for nats-py, unless it is larger than its buffer)."""
        self.messages = 0

    def put(self, subject: str, data: bytes, headers: Headers | None, *, now: bool = False) -> None:
        """Queue one message. Raises :class:`MeshError` (``unavailable``), once, when an earlier
        message on the same subject could not be published (the connection is closed, its
        reconnect buffer is full, or the message was too large); that message is lost, as a
        failed publish would have lost it. Other subjects are not told."""
        if self._dropped:
            failure = self._dropped.pop(subject, None)
            if failure is not None:
                raise MeshError(f"cannot publish events: {failure}", code=ErrorCode.UNAVAILABLE)
        self._queued.append((subject, data, headers))
        if self._scheduled is not None and (self._urgent or not now):
            return
        loop = asyncio.get_running_loop()
        wait = 0.0 if now else self._last + self.gap - loop.time()
        if self._scheduled is not None:
            self._scheduled.cancel()
        self._urgent = wait <= 0
        self._scheduled = (
            loop.call_soon(self._write_queued)
            if wait <= 0
            else loop.call_later(wait, self._write_queued)
        )

    def _write_queued(self, write: bool = True) -> bool:
        """Hand everything queued to nats-py, in order, here and now (nothing waits), and
        write it to the socket unless ``write`` is False (:meth:`hand_over`); the scheduled
        write's own callback too."""
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
        queued, self._queued = self._queued, []
        if not queued:
            return True
        self._last = asyncio.get_running_loop().time()
        self.writes += 1
        self.messages += len(queued)
        client = self.client
        failed = 0
        frames: list[bytes] = []  # built here, not yet handed to nats-py
        first = 0  # the index in ``queued`` of the first of them
        try:
            _check_state(client)
            limit = client.max_payload
            for index, (subject, data, headers) in enumerate(queued):
                if len(data) <= limit and _PLAIN_SUBJECT(subject):
                    if headers is None:
                        frames.append(_frame(subject, data))
                        continue
                    if type(headers) is bytes:
                        frames.append(_frame_with(subject, headers, data))
                        continue
                _pending(client, frames)  # the frames before it go first
                frames, first = [], index
                try:  # nats-py's own publish, in its place
                    _publish_now(client, subject, data, _as_dict(headers))
                except _ONE_MESSAGE as exc:  # that message alone
                    failed += self._drop([subject], exc)
                first = index + 1
            _pending(client, frames)
        except Exception as exc:  # closed, or the reconnect buffer is full: the rest too
            failed += self._drop([m[0] for m in queued[first:]], exc)
        if write:
            write_queued(client, at_least=1)
        if failed:
            self.failures += 1
            log.warning("answer events not published", count=failed, of=len(queued))
        return not failed

    async def flush(self) -> bool:
        """Publish everything queued, in order; False when some of it could not be: a message
        too large is skipped, and after an error of the connection the rest of the burst is
        dropped. :attr:`failures` counts such bursts, and the next :meth:`put` on a subject
        that lost a message raises. Never raises a publish error."""
        return self._write_queued()

    def hand_over(self) -> bool:
        """:meth:`flush`, but left to nats-py to write: for a caller that publishes through
        nats-py at once (an answer's end, through JetStream), whose message then goes out in
        the same write as these (a system call less per answer, here and in nats-server)."""
        return self._write_queued(write=False)

    def behind(self) -> None:
        """Let the tasks woken so far put first: a write due at the loop's next turn goes
        after the callbacks scheduled meanwhile. An edge's relay woken by an answer's end that
        came in the same read as its last tokens (passed on in the read, the end through the
        relay's task) then puts the end into the same write as those tokens."""
        if self._scheduled is not None and self._urgent:
            self._scheduled.cancel()
            self._scheduled = asyncio.get_running_loop().call_soon(self._write_queued)

    def _drop(self, subjects: list[str], exc: Exception) -> int:
        """Remember why these subjects lost a message: the next put on each raises."""
        for subject in subjects:
            self._dropped[subject] = type(exc).__name__
        while len(self._dropped) > MAX_DROPPED:  # answers that ended and never put again
            del self._dropped[next(iter(self._dropped))]
        return len(subjects)

    async def close(self) -> None:
        """Publish what is queued (before the connection drains) and stop."""
        await self.flush()


_PLAIN_SUBJECT = re.compile(r"[^ \t\r\n]+").fullmatch
"""A subject nats-py's publish takes as it is (it refuses blanks and line breaks, which would
let a subject inject protocol lines)."""


def _frame(subject: str, data: bytes) -> bytes:
    """The protocol line nats-py's ``publish`` writes for a message without headers."""
    return b"PUB %s %d\r\n%s\r\n" % (subject.encode(), len(data), data)


def _frame_with(subject: str, block: bytes, data: bytes) -> bytes:
    """The protocol line nats-py's ``publish`` writes for a message with headers, from their
    block (:func:`header_block`)."""
    return b"HPUB %s %d %d\r\n%s%s\r\n" % (
        subject.encode(),
        len(block),
        len(block) + len(data),
        block,
        data,
    )


_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+").fullmatch
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})


def header_block(headers: dict[str, str]) -> bytes:
    """Headers as nats-py writes them on the wire (``NATS/1.0``, a line each, an empty line),
    for a sender whose headers never change: encoded once, not per message. Keys and values
    are checked and cleaned as nats-py does: raises ``BadHeaderError`` for a key it would
    refuse; line breaks in a value become blanks."""
    lines = [b"NATS/1.0"]
    for name, value in headers.items():
        key = name.strip()
        if not key:
            continue
        if not _HEADER_KEY(key):
            raise nats.errors.BadHeaderError(key)
        lines.append(b"%s: %s" % (key.encode(), value.strip().translate(_NEWLINES).encode()))
    return b"\r\n".join(lines) + b"\r\n\r\n"


CONTENT_TYPE_BLOCKS = {fmt: header_block({CONTENT_TYPE: fmt.content_type}) for fmt in WireFormat}
"""The header block of each wire format's events (every one but a token carries its
content type)."""


def _as_dict(headers: Headers | None) -> dict[str, str] | None:
    """Headers as nats-py's ``publish`` takes them (a block read back into its lines)."""
    if headers is None or isinstance(headers, dict):
        return headers
    lines = headers.decode().split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)


def _check_state(client: Client) -> None:
    """What nats-py's ``publish`` checks of the connection first: raises as it would."""
    if client.is_closed:
        raise nats.errors.ConnectionClosedError
    if client.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError


def _pending(client: Client, frames: list[bytes]) -> None:
    """Put ``frames`` where nats-py keeps what it has yet to write, as its
    ``publish`` does: while it reconnects, only within its reconnect buffer, else raising
    ``OutboundBufferLimitError``. Leans on the attributes its flusher uses (see
    :mod:`mesh.write_now`)."""
    if not frames:
        return
    blob = b"".join(frames) if len(frames) > 1 else frames[0]
    size = len(blob)
    pending_size = client._pending_data_size
    if not client.is_connected:
        limit = client._max_pending_size
        if limit <= 0 or pending_size + size > limit:
            raise nats.errors.OutboundBufferLimitError
    client._pending.append(blob)
    client._pending_data_size = pending_size + size
    stats = client.stats
    stats["out_msgs"] += len(frames)
    stats["out_bytes"] += size  # the frames' bytes, where nats-py counts payloads


def _publish_now(client: Client, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
    """``client.publish`` run to its end here, without a task: nats-py's publish only queues
    the message for its flusher and returns, without waiting, unless its buffer is over
    ``pending_size``; then, with the message already queued and the flusher called, it waits
    for the write. That wait is left out (the flusher writes it all the same). Raises what
    ``publish`` raises."""
    coro = client.publish(subject, data, headers=headers)
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()


HEADERS_ROOM = 1024
"""What a message's headers may take of the server's ``max_payload`` (which counts them)."""


def room(client: Client) -> int:
    """The largest payload one message to ``client``'s server can carry, with its headers."""
    return int(client.max_payload) - HEADERS_ROOM
