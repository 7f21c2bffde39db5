"""JetStream publishes that wait for the store's ack, their acks read in the connection's read
loop.

nats-py's ``JetStreamContext.publish`` goes through ``Client.request``: a random token per
request, ``asyncio.wait_for`` on a future, and the answer handed from the read loop to the
request subscription's task before it resolves that future. Every request the SDK or an edge
queues, and every answer's end a worker stores, pays that on the way. Here one subscription per
connection (``<inbox>.*``, :mod:`mesh.inline_sub`) takes every ack in the read loop; a
publish is a counter, a future, a timer and the publish itself. Measured against a real
nats-server, 200 publishes at a time: 21.4 to 21.8 us of the publisher's CPU each, against
35.5 to 43.6 through nats-py (``docs/performance.md``).

The outcome is nats-py's, to the type: the ``PubAck``, an ``APIError`` for the store's refusal,
``NoStreamResponseError`` when no stream takes the subject, ``nats.errors.TimeoutError`` when
no ack comes in time. The subscription is a plain one: nats-py restores it after a
reconnect.

A publish whose ack has not come when the connection comes back may have gone into the dying
link. One that carries a ``Nats-Msg-Id`` is published again at once (:meth:`Acks.again`): the
stream stores it once whatever reached it, and the first ack to come answers it (a duplicate's
says so). Through nats-py it waited out its timeout (5 s) and failed. Such a publish is also
sent again each :data:`RESEND_AFTER_S` (or three times the connection's usual ack time, if
longer: a slow link) its ack does not come in which the connection heard nothing at all: what
a link that went silent for a moment carried is lost with no reconnect to tell (a client's link
frozen without a reset, a quiet leaf whose uplink dropped and came back), and the request
waited out the whole timeout. A connection that hears other messages is alive, its ack only
late (a busy hub, an election): nothing is sent again. On a leaf node's connection (an edge
site's) what it hears says nothing of the hub (the leaf's own link stays busy while its uplink
is silent): such a publish is sent again each time its ack is late. One without an id waits
for its ack, as through nats-py: published twice, it might be stored twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api

from mesh.inline_sub import subscribe_inline
from mesh.write_now import write_queued

NO_RESPONDERS = "503"
MSG_ID = "Nats-Msg-Id"
LOOK_AFTER_S = 1.0
"""How long a publish given a ``gone`` check waits for its ack before it looks whether its
stream is still there (an ack takes milliseconds; a store electing a leader, seconds)."""
RESEND_AFTER_S = 1.0
"""How long a publish with a ``Nats-Msg-Id`` waits for its ack, hearing nothing, before it is
sent again (and again each time as long, while its timeout lasts): an ack takes milliseconds."""
Gone = Callable[[], Awaitable[bool]]


class Acks:
    """The acks of one connection's JetStream publishes (see the module's docstring)."""

    def __init__(self, nc: Client, round_trip: float = 0.0, *, on_leaf: bool = False) -> None:
        """``on_leaf``: a connection to a leaf node (an edge site's), whose own link stays
        busy while its uplink to the hub is silent: what it hears says nothing of the hub, and
        a publish with an id is sent again each time its ack is late (:meth:`_due`)."""
        self._nc = nc
        self._on_leaf = on_leaf
        self._prefix = nc.new_inbox()
        self._pending: dict[str, asyncio.Future[Msg]] = {}
        self._unacked: dict[str, tuple[str, bytes, dict[str, str]]] = {}
        """The publishes with a ``Nats-Msg-Id`` still waiting for their ack (see :meth:`again`)."""
        self._next = 0
        self._sub: Subscription | None = None
        self._subscribing = asyncio.Lock()
        self._looks: dict[asyncio.Future[Msg], asyncio.Task[None]] = {}
        """The looks under way, by the publish they look for (cancelled when it ends)."""
        self._given: dict[asyncio.Future[Msg], Gone] = {}
        """The publishes waiting for their ack that were given a ``gone`` check, with it."""
        self._timers: dict[str, asyncio.TimerHandle] = {}
        """Each publish's next timer: its timeout, or before it its next time to send again."""
        self._sending: set[asyncio.Task[None]] = set()
        self._ack_s = round_trip
        """The usual time to an ack here (a moving average from the link's round trip): a slow
        link's acks come late."""

    async def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        timeout: float,
        stream: str | None = None,
        headers: Mapping[str, str] | None = None,
        gone: Gone | None = None,
    ) -> api.PubAck:
        """Publish ``payload`` on ``subject`` and wait up to ``timeout`` seconds for the store's
        ack (from ``stream`` only, when given).

        ``gone``: with no ack after :data:`LOOK_AFTER_S`, this is asked whether the stream is
        there at all; when it says gone, the publish ends ``NoStreamResponseError`` then, not at
        ``timeout``. A subject a reader subscribes to gets no "no responders" when its stream is
        deleted: only the ack that never comes tells, and a worker held the request's slot for
        the whole timeout (5 s) at every answer's end."""
        if self._sub is None:
            await self._subscribe()
        hdr = dict(headers) if headers else {}
        if stream is not None:
            hdr[api.Header.EXPECTED_STREAM] = stream
        self._next += 1
        token = str(self._next)
        loop = asyncio.get_running_loop()
        acked: asyncio.Future[Msg] = loop.create_future()
        self._pending[token] = acked
        deadline = loop.time() + timeout
        first = timeout
        if MSG_ID in hdr:
            self._unacked[token] = (subject, payload, hdr)
            first = min(timeout, self._resend_after())
        heard = self._nc.stats["in_msgs"]
        self._timers[token] = loop.call_later(first, self._due, token, deadline, heard)
        look = None
        if gone is not None:
            look = loop.call_later(LOOK_AFTER_S, self._look, acked, gone)
            self._given[acked] = gone
        try:
            await self._nc.publish(
                subject, payload, reply=f"{self._prefix}.{token}", headers=hdr or None
            )
            write_queued(self._nc)  # a burst leaves in groups (mesh.write_now)
            msg = await acked
            self._ack_s += 0.1 * (loop.time() - (deadline - timeout) - self._ack_s)
        finally:
            self._timers.pop(token).cancel()
            if look is not None:
                look.cancel()
                del self._given[acked]
                looking = self._looks.pop(acked, None)
                if looking is not None:  # its answer no longer matters
                    looking.cancel()
            self._pending.pop(token, None)
            self._unacked.pop(token, None)
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS:
            raise nats.js.errors.NoStreamResponseError
        resp = json.loads(msg.data)
        if "error" in resp:
            raise nats.js.errors.APIError.from_error(resp["error"])
        return api.PubAck.from_response(resp)

    async def again(self) -> int:
        """Publish again, now, every publish with a ``Nats-Msg-Id`` still waiting for its ack
        (after a reconnect: it may have gone into the dying link); how many."""
        unacked = list(self._unacked.items())
        for token, (subject, payload, hdr) in unacked:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=hdr)
        return len(unacked)

    def stream_gone(self, gone: Gone) -> int:
        """End now, with ``NoStreamResponseError``, every publish waiting for its ack that was
        given ``gone``: its stream was deleted (JetStream said so), so no ack will come; how
        many."""
        waiting = [acked for acked, given in self._given.items() if given == gone]
        for acked in waiting:
            if not acked.done():
                acked.set_exception(nats.js.errors.NoStreamResponseError())
        return len(waiting)

    async def _subscribe(self) -> None:
        async with self._subscribing:
            if self._sub is None:
                self._sub = await subscribe_inline(self._nc, f"{self._prefix}.*", self._on_ack)

    def _on_ack(self, msg: Msg) -> None:
        """In the read loop: the ack (or the server's "no responders") of one publish."""
        acked = self._pending.pop(msg.subject.rpartition(".")[2], None)
        if acked is not None and not acked.done():
            acked.set_result(msg)

    def close(self) -> None:
        """Cancel the looks and the sends again under way (the connection closes)."""
        for task in [*self._looks.values(), *self._sending]:
            task.cancel()
        self._looks.clear()

    def _look(self, acked: asyncio.Future[Msg], gone: Gone) -> None:
        self._looks[acked] = asyncio.get_running_loop().create_task(self._looked(acked, gone))

    async def _looked(self, acked: asyncio.Future[Msg], gone: Gone) -> None:
        try:
            missing = await gone()
        except Exception:  # a look that fails says nothing: the ack's own timeout stands
            return
        finally:
            if self._looks.get(acked) is asyncio.current_task():
                del self._looks[acked]
        if missing and not acked.done():
            acked.set_exception(nats.js.errors.NoStreamResponseError())

    def _due(self, token: str, deadline: float, heard: int) -> None:
        """A publish's timer: past its deadline it times out; before, it is sent again when the
        connection, up, heard nothing since ``heard`` (a reconnect sends it again by itself),
        and its timer is set anew."""
        loop = asyncio.get_running_loop()
        left = deadline - loop.time()
        if left <= 0.001 or token not in self._unacked:
            self._expire(token)
            return
        now_heard = self._nc.stats["in_msgs"]
        # A leaf's link hears the site (its pulls' heartbeats, registry updates, the site's own
        # streams' acks) while the uplink is silent: a forward lost in 1.5 s of silence at a
        # busy site was never sent again, and the site's outbox stood still for its whole
        # timeout and a pause, 4.7 s (review S27d). Sent again, the hub drops the repeat.
        if self._nc.is_connected and (self._on_leaf or now_heard == heard):
            task = loop.create_task(self._send_again(token))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._timers[token] = loop.call_later(
            min(left, self._resend_after()), self._due, token, deadline, now_heard
        )

    def _resend_after(self) -> float:
        """How long an unacked publish waits, hearing nothing, before it is sent again: a
        second, or three times the usual ack time on a slow link."""
        return max(RESEND_AFTER_S, 3 * self._ack_s)

    async def _send_again(self, token: str) -> None:
        entry = self._unacked.get(token)
        if entry is None:
            return
        subject, payload, hdr = entry
        try:
            await self._nc.publish(subject, payload, reply=f"{self._prefix}.{token}", headers=hdr)
        except nats.errors.Error:
            return  # the link went meanwhile: the reconnect sends it again
        write_queued(self._nc)

    def _expire(self, token: str) -> None:
        acked = self._pending.pop(token, None)
        if acked is not None and not acked.done():
            acked.set_exception(nats.errors.TimeoutError())
