"""A pull consumer read by a loop, one batch at a time, that hears at once when the consumer is
gone.

nats-py's ``fetch`` takes JetStream's "409 Consumer Deleted" for "no messages yet" and waits out
its timeout, and a pull request lost with a reconnect for a request still open: a site's
collector, pulling for 5 s at a time, collected nothing for up to 5 s after its consumer was made
again, or its link came back. :class:`Pull` keeps one subscription for all its pull requests and
sends the next request only when the last one is over (filled, expired, ended by a status), so
messages arrive in a loop's hands as they come, not when a batch fills:

- a request the server ends because the consumer (or its stream) is gone, "409 Consumer Deleted",
  that nobody answers, "503", or that the server refuses (a 400, a 409 the next request would
  get as well), raises :class:`PullLost` from :meth:`Pull.fetch` at once;
- so does a request the server stopped speaking for: each asks for JetStream's idle heartbeats,
  and two missed, or no status by its expiry, mean the request is gone (a consumer missing
  behind a leaf node's domain gets no 503, only silence; a hub restarted under a leaf node, or
  an uplink cut, drops the request without a word); the first heartbeat and the expiry's
  status are waited for a round trip (:attr:`Pull.rtt`) longer;
- a reconnect of the connection ends the open request on the spot (it may have gone with the old
  link); its deliveries that still come are kept for the next fetch, never dropped, and those
  not fetched when the pull stops are handed back (nak);
- deliveries the server sent into a link as it went are counted delivered and unacked, and
  JetStream sends them again only after the consumer's ack wait (30 s on a site's consumers).
  After a reconnect, lost heartbeats or an expiry without a word, once the loop holds nothing
  and has no request open, :meth:`Pull.redeliver` looks: if the consumer still counts
  deliveries unacked, it is reset to its ack floor (``CONSUMER.RESET``, nats-server 2.14+),
  which sends them again now.

Deliveries carry their stream subject, not the request's reply subject, so one that comes late
for an older request counts against the open one: that one may then be taken for filled and a
next asked for early (one more request open at the server, until its expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from mesh.inline_sub import subscribe_inline
from mesh.logs import get_logger

log = get_logger(__name__)

HEARTBEAT = "100"
OVER = ("404", "408")
"""Statuses that end a request as expected: nothing to deliver, or expired."""
PASSING = ("leadership change", "server shutdown", "batch completed", "exceeds maxbytes")
"""409s that end one request for a passing reason: the next is asked for at once. Any other
status (409 Consumer Deleted, 503, a 400 or a 409 the next request would get too) raises
:class:`PullLost`, which the caller answers with a pause."""
EXPIRY_MARGIN_S = 0.25
"""How long after a request's expiry a fetch gives it up without the status that says so."""
NAK_WITHIN_S = 1.0
STALE_LOOKS = 3
"""Looks at a consumer with deliveries unacked and others' requests waiting before
:meth:`Pull.redeliver` resets it all the same (a caller pulling for 1 s: about 2 s)."""


RESET_TRIES = 3
"""Failed resets in a row (no answer in time, nobody serving it) before a pull asks only once
every ``RESET_AGAIN_S`` (a refusal for good: never again)."""
RESET_AGAIN_S = 60.0
MAX_RTT_S = 1.0
"""The most a measured round trip adds to the waits for a pull's first heartbeat and expiry
(one sample, taken after a loss, may be one slow answer of a hub still recovering)."""


class PullLost(nats.errors.Error):
    """The server says the consumer is gone (its pull request ended "409 Consumer Deleted"),
    nobody serves it ("503"), or its heartbeats stopped or its expiry came without a word: the
    consumer may have to be made again, or the link to it come back, before anything more
    comes."""


class Refused(ValueError):
    """An error answer of the JetStream API."""

    def __init__(self, call: str, error: dict[str, Any]) -> None:
        super().__init__(f"{call}: {error}")
        self.code = int(error.get("code", 0))


class Pull:
    """Pull requests to ``consumer`` on ``stream`` through ``prefix`` (a JetStream API prefix,
    ``$JS.API`` or a domain's), read by :meth:`fetch`."""

    def __init__(
        self, conn: Connection, stream: str, consumer: str, *, prefix: str, heartbeat: float
    ) -> None:
        self.conn = conn
        self._heartbeat = heartbeat
        """Seconds between the server's idle heartbeats while a request waits."""
        self._api = f"{prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self.stream, self.consumer, self._prefix = stream, consumer, prefix
        self._got: deque[Msg] = deque()
        self._sub: Subscription | None = None
        self._inbox = ""
        self._reply = ""
        """The reply subject of the open request ("" when none is open)."""
        self._owed = 0
        self._ends_at = 0.0
        self._heard = 0.0
        """When the open request was last heard of (``loop.time()``)."""
        self._gone: str | None = None
        self._wake = asyncio.Event()
        self._undo: Callable[[], None] | None = None
        self._count = 0
        self._reconnects = 0
        self.link_lost = False
        """A link may have taken deliveries with it since the last :meth:`redeliver`."""
        self._looks = 0
        self._failed_resets = 0
        """Resets failed in a row (:data:`RESET_TRIES` once the server refused one for good)."""
        self._reset_again_at: float | None = None
        """When a pull that stopped asking after timeouts asks again (None: refused for good,
        or asking as usual). A timeout says nothing lasting: an election, a flapping link."""
        self.rtt = 0.0
        """Seconds a round trip to the consumer's server takes, as the caller last measured it:
        the first heartbeat of a request is waited for that much longer (a slow uplink)."""

    async def start(self) -> None:
        nc = self.conn.nc
        self._inbox = nc.new_inbox()
        self._sub = await subscribe_inline(nc, f"{self._inbox}.*", self._on_msg)
        self._reconnects = self.conn.reconnects
        self._undo = self.conn.on_loss(self._lost)

    async def stop(self) -> None:
        """Unsubscribe, and hand back what came and was not fetched (to the next pull, not
        after its ack wait)."""
        if self._undo is not None:
            self._undo()
            self._undo = None
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await sub.unsubscribe()
        got = list(self._got)
        self._got.clear()
        await hand_back(got)

    async def fetch(self, batch: int, timeout: float) -> list[Msg]:
        """The messages delivered so far, waiting up to ``timeout`` seconds for the first; an
        empty list when none came. Asks for ``batch`` more when no request is open. Raises
        :class:`PullLost`, or nats-py's error when the request cannot be sent."""
        loop = asyncio.get_running_loop()
        if not self._got and not self._reply and self._gone is None:
            await self._ask(batch, timeout)
        while not self._got and self._reply and self._gone is None:
            now = loop.time()
            # Over without the status that says so, or silent: lost with a link (a pull shorter
            # than two heartbeats reaches its expiry first).
            expired = now >= self._ends_at
            if expired or now - self._heard >= 2 * self._heartbeat + EXPIRY_MARGIN_S:
                self._reply = ""
                silent = f"no heartbeat for {now - self._heard:.1f} s"
                self._gone = "no word by its expiry" if expired else silent
                self.link_lost = True
                break
            left = min(self._ends_at, self._heard + 2 * self._heartbeat + EXPIRY_MARGIN_S) - now
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(left, 0.001))
        if self._gone is not None and not self._got:
            why, self._gone = self._gone, None  # the next fetch asks again
            raise PullLost(why)
        got = list(self._got)
        self._got.clear()
        return got

    async def _ask(self, batch: int, timeout: float) -> None:
        self._count += 1
        reply = f"{self._inbox}.{self._count}"
        self._heartbeat = min(self._heartbeat, timeout / 2)  # else the server refuses it (400)
        request = {
            "batch": batch,
            "expires": int(timeout * 1e9),
            "idle_heartbeat": int(self._heartbeat * 1e9),
        }
        self._reply, self._owed = reply, batch
        now = asyncio.get_running_loop().time()
        rtt = min(self.rtt, MAX_RTT_S)
        self._heard = now + rtt  # the first heartbeat comes a round trip later
        self._ends_at = now + rtt + timeout + EXPIRY_MARGIN_S
        try:
            await self.conn.nc.publish(self._api, json.dumps(request).encode(), reply=reply)
        except nats.errors.Error:
            self._reply = ""
            raise

    def _on_msg(self, msg: Msg) -> None:
        """In the connection's read loop: a delivery (kept, whichever request it answers) or a
        status that ends a request (heeded only for the open one)."""
        status = msg.headers.get("Status") if msg.headers else None
        if status is None or msg.reply:  # a delivery has an ack subject, a status never
            self._got.append(msg)
            self._heard = asyncio.get_running_loop().time()
            self._owed -= 1
            if self._owed <= 0:
                self._reply = ""  # filled: JetStream sends nothing more for it
            self._wake.set()
            return
        if msg.subject != self._reply:
            return  # an older request's
        if status == HEARTBEAT:
            self._heard = asyncio.get_running_loop().time()
            return
        self._reply = ""
        reason = (msg.headers or {}).get("Description", "")
        passing = status == "409" and any(p in reason.lower() for p in PASSING)
        if status not in OVER and not passing:
            self._gone = f"{status} {reason}".strip()
        self._wake.set()

    def _lost(self) -> None:
        """The link came back: the open request may be gone with the old one. Messages dropped
        elsewhere on a live link (a slow consumer) are not: this subscription takes its own in
        the read loop and never drops one, and asking again for each drop would pile up pull
        requests at the hub while the edge is overloaded already."""
        if self.conn.reconnects == self._reconnects:
            return
        self._reconnects = self.conn.reconnects
        self._reply = ""
        self.link_lost = True
        self._wake.set()

    async def redeliver(self) -> None:
        """After a link may have taken deliveries with it (:attr:`link_lost`), with nothing
        held and no request open: reset the consumer when it counts deliveries unacked, so
        that they come again now, not after its ack wait.

        A pull request the link left behind may still wait at the server (one sent through a
        leaf node, under accounts, outlives its requester until it expires): the reset would
        hand them to it, and they would be lost again, as would anything delivered to it until
        then. While the consumer counts requests waiting, none of them this pull's, it looks
        again at the next fetch, up to :data:`STALE_LOOKS` times; then it resets all the same
        (the requests are another reader's: an edge's replica on the same site consumer).

        The reset rewinds the whole consumer to its ack floor: what another reader holds comes
        again, and its ack of it is ignored (it gets no confirmation), as may be this loop's own
        last acks, not yet applied. Each such message is then handled twice, which the site's
        loops make harmless: a forward again is dropped by the hub's queue as a duplicate, an
        answer kept again by the site's store, both by message id."""
        if not self.link_lost or self._got or self._reply:
            return
        try:
            info = await self._api_call("INFO")
            unacked, waiting = info.get("num_ack_pending", 0), info.get("num_waiting", 0)
            self._looks += 1
            if waiting and self._looks < STALE_LOOKS:
                return  # look again once requests the link left behind expired (they may
                # take deliveries until then, unacked or not yet)
        except (asyncio.TimeoutError, nats.errors.Error, ValueError) as exc:
            log.debug("unacked deliveries not looked at", consumer=self.consumer, error=repr(exc))
            return  # looked at again at the next fetch
        self.link_lost, self._looks = False, 0
        if unacked and self._resets:
            await self._reset(unacked, waiting)

    @property
    def _resets(self) -> bool:
        """Whether the server may still take ``CONSUMER.RESET`` from this pull."""
        again = self._reset_again_at
        return self._failed_resets < RESET_TRIES or (
            again is not None and time.monotonic() >= again
        )

    async def _reset(self, unacked: int, waiting: int) -> None:
        try:
            await self._api_call("RESET")
        except (asyncio.TimeoutError, nats.errors.Error, ValueError) as exc:
            # A bad request is a server before 2.14; no answer in time, RESET_TRIES times in a
            # row after a look that got one, most likely credentials without the right (a
            # permission violation gets no answer). Anything else passes (a leader election, the
            # consumer being made again): looked at again at the next fetch. Given up, it is
            # not asked for again: it would wait as long for nothing.
            refused = isinstance(exc, Refused) and exc.code in (400, 403)
            self._failed_resets = RESET_TRIES if refused else self._failed_resets + 1
            again, self._reset_again_at = self._reset_again_at, None
            if not refused and self._failed_resets >= RESET_TRIES:
                self._reset_again_at = time.monotonic() + RESET_AGAIN_S
            if self._resets:
                self.link_lost = True
                return
            if again is not None:  # asked again, and again no answer: said so already
                return
            log.warning(
                "cannot reset the consumer: deliveries lost with a link come again after its "
                "ack wait (it needs nats-server 2.14, and edge credentials minted by "
                "`mesh creds` since; run it again)",
                consumer=self.consumer,
                error=repr(exc),
            )
            return
        self._failed_resets, self._reset_again_at = 0, None
        log.info(
            "deliveries lost with a link; sent again",
            consumer=self.consumer,
            unacked=unacked,
            waiting=waiting,
        )

    async def _api_call(self, call: str) -> dict[str, Any]:
        """``CONSUMER.<call>`` on this pull's consumer (its JSON answer). Raises
        :class:`Refused` for an error answer (``CONSUMER.RESET`` needs nats-server 2.14)."""
        subject = f"{self._prefix}.CONSUMER.{call}.{self.stream}.{self.consumer}"
        reply = await self.conn.nc.request(subject, b"", timeout=self.conn.settings.request_timeout)
        answer: dict[str, Any] = json.loads(reply.data)
        if "error" in answer:
            raise Refused(call, answer["error"])
        return answer


async def hand_back(msgs: list[Msg], delay: float | None = None) -> None:
    """Nak ``msgs`` (best effort): the server delivers them again now (or ``delay`` seconds
    from now), not after ack wait."""
    for msg in msgs:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await asyncio.wait_for(msg.nak(delay=delay), NAK_WITHIN_S)
