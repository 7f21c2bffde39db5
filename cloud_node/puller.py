"""The worker's pull consumer: JetStream pull requests kept outstanding for exactly the worker's
free slots, deliveries taken in a callback and handed on at once.

nats-py's ``fetch`` waits for a batch (or its end) before returning and spends a task and a
timeout on every message; a worker behind it picks up a burst of requests one batch at a time.
Here each pull request has an inbox and a subscription of its own (JetStream delivers pulled
messages under their stream subject, so only the subscription tells which request a message
answers; a filled request's subscription serves the next request), and the puller knows how
many messages each still owes; JetStream ends a request with
a status (408 when it expires, 409 when the consumer cannot serve it), and what it still owed
goes back to the pool. Back-pressure is
unchanged: the messages asked for never exceed the free slots.

Every message of a pull request is handled in the connection's read loop as it is parsed
(:mod:`mesh.inline_sub`), and a pull request that ends is renewed there, written at once. The
requests expire every ``expires`` seconds (short, so a frozen worker's requests cannot hold
deliveries for long), and an expiry can fall inside a burst: until the renewal reaches the
server, the rest of the burst waits in the stream. Taken in the subscription's own task and
written by nats-py's flusher, the renewal waited two more turns of a loop busy with the burst's
first requests (``tests/test_puller.py``: at the server five 0.1 s callbacks after the expiry,
three now). End to end, ``scripts/ab_bench.py`` saw no change beyond its spread
(``docs/performance.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
from collections.abc import Callable
from urllib.parse import ParseResult

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from mesh.eager import run_now
from mesh.inline_sub import retarget, subscribe_inline
from mesh.logs import get_logger
from mesh.round_trip import round_trip
from mesh.write_now import write_queued

log = get_logger(__name__)
MAX_REQUESTS = 8
"""Pull requests one worker keeps outstanding at most (the consumer's max_waiting is shared)."""
HEARTBEAT = "100"
EXPIRY_MARGIN_S = 0.1
"""After a request's expiry, how long before the puller counts it over without the status
that says so (lost with a link): the server's expiry runs from when it read the request."""
MAX_RTT_S = 1.0
"""The most of a measured round trip added to a request's expiry."""
LINGER_S = 5.0
"""How long the subscription of a request counted over that way stays, for a late delivery."""
DRAIN_S = 1.0
"""How long a stopping puller waits for the server's word that its pull requests ended (the
messages on their way before it are handed back as they come)."""


class Puller:
    def __init__(
        self,
        conn: Connection,
        stream: str,
        consumer: str,
        *,
        free_slots: Callable[[], int],
        total_slots: Callable[[], int],
        deliver: Callable[[Msg], None],
        expires: float,
        batch: int = 1_000_000,
        on_lost: Callable[[str], None] | None = None,
        expiry: Callable[[], float] | None = None,
    ) -> None:
        """``expiry``: the seconds a new pull request may stay open, when less than
        ``expires`` (one asked only for slots promised to stopping peers lasts as they do)."""
        self.conn = conn
        self._batch = batch
        """The most messages one pull request asks for (``fetch_batch``; more where
        :data:`MAX_REQUESTS` of them could not cover every slot otherwise)."""
        self.rtt = 0.0
        """A round trip to the server, as last measured (:meth:`measure`): a request's expiry
        and its status come that much later over a slow link. Not counted, a 1-slot worker
        behind 0.4 s of delay asked again for its slot before the status of the request that
        covered it came, and took two deliveries."""
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._free = free_slots
        self._total = total_slots
        self._deliver = deliver
        self._expires = expires
        self._expiry = expiry
        self._on_lost = on_lost
        """Told (in the read loop) when the server says the consumer is gone: a pull request
        ended with "Consumer Deleted" (its stream's too), or nobody answers a new one (503)."""
        self._owed: dict[int, int] = {}
        self._measured = -math.inf
        self._probes: set[asyncio.Task[None]] = set()
        self._probe_at: float | None = None
        """When the probe on its way was sent (:meth:`measure`)."""
        self._asked: dict[int, tuple[float, float]] = {}
        """When each open request was asked (``loop.time()``), and its expiry: it is over for
        sure its expiry, :data:`EXPIRY_MARGIN_S` and a round trip (:attr:`rtt`, as now
        measured) later."""
        self._lingering: dict[int, float] = {}
        """Requests given up at their expiry, their subscriptions kept until then."""
        self._server: ParseResult | None = None
        """The server the last request was asked of."""
        self._subs: dict[int, Subscription] = {}
        self._spares: list[Subscription] = []
        """Subscriptions of filled pull requests, for the next ones: JetStream sends nothing
        more to a filled request's inbox, so the next request asked there costs no SUB, no
        UNSUB (written alone, between a delivery's engine call and its first event) and no
        interest change at the server."""
        self._next = 0
        self._stopped = True
        self._closing: set[asyncio.Task[None]] = set()
        self._renewing: set[asyncio.Task[None]] = set()
        self.last_delivery = ""
        """The ack subject of the last message delivered (where a lost one's sequence begins)."""

    @property
    def outstanding(self) -> int:
        """Messages asked for and not yet delivered."""
        return sum(self._owed.values())

    async def start(self) -> None:
        self._stopped = False
        await self.measure()
        await self.top_up()

    async def tick(self) -> None:
        """The worker's tick: cover every free slot; once a second, measure the round trip."""
        if asyncio.get_running_loop().time() - self._measured >= 1.0:
            await self.measure()
        await self.top_up(whole=True)

    async def measure(self) -> None:
        """Measure the round trip to the server (at start, after each reconnect, and every
        second from the worker's tick: a link may grow slow while it stays up), without waiting
        for it: a round trip never cut short (:mod:`mesh.round_trip`; nats-py's ``rtt`` with a
        short timeout stopped the connection's reading), timed when it ends."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._measured = now
        if self._probe_at is not None and now - self._probe_at < MAX_RTT_S:
            return  # one on its way: its end is the measure
        # Another after a second: one a reconnect dropped (nats-py forgets its PING) never ends.
        self._probe_at = now
        probe = round_trip(self.conn.nc, self._probes)
        probe.add_done_callback(functools.partial(self._on_probe, now))

    def _on_probe(self, sent: float, probe: asyncio.Task[None]) -> None:
        if not probe.cancelled() and probe.exception() is None:
            self.rtt = min(asyncio.get_running_loop().time() - sent, MAX_RTT_S)
            if self._probe_at is not None and self._probe_at <= sent:
                self._probe_at = None  # the latest one is back

    def _round_trip(self, now: float) -> float:
        """The round trip as measured, or longer while a probe is out that long."""
        out = 0.0 if self._probe_at is None else now - self._probe_at
        return min(max(self.rtt, out), MAX_RTT_S)

    async def stop(self) -> None:
        """Ask for nothing more, and end the open pull requests at the server: each is drained
        (its subscription ends at the server, and is kept until a round trip says nothing
        more comes), and what comes meanwhile is handed back (naked) after the server heard
        it. Unsubscribed at once, a message already on its way was dropped here and waited
        out ack_wait, a delivery burnt. (With a leaf node connected, nats-server 2.15 may
        still deliver to a pull request asked within about 250 ms after its UNSUB: review
        S18f saw it, and saw such requests answered promptly all the same.)"""
        self._stopped = True
        subs, self._subs = list(self._subs.values()), {}
        subs += self._spares
        self._spares = []
        if subs and self.conn.connected:
            nc = self.conn.nc
            with contextlib.suppress(nats.errors.Error):
                for sub in subs:  # UNSUB only: the callback stays (nats-py's drain, unbounded)
                    await nc._send_unsubscribe(sub._id)
                probe = round_trip(nc, self._probes)  # after the server heard, all came
                work = asyncio.wait_for(asyncio.shield(probe), DRAIN_S)
                with contextlib.suppress(asyncio.TimeoutError):
                    await self.conn.while_linked(work, DRAIN_S)
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        # Probes still out are left to end by themselves: never cancelled (mesh.round_trip).
        for task in [*self._closing, *self._renewing]:
            await task

    def forget(self, *, asked_before: float | None = None) -> None:
        """After a reconnect: give up the requests whose expiry passed meanwhile (the status
        that ended each may have been lost with the link), or all of them when the link came
        back to another server (they may have gone with the one they were asked of), and those
        asked before ``asked_before`` (a loop time: the consumer was made anew, and they went
        with the one before; one asked after may be of the new one). Back at
        the same server, those still within their expiry are kept: nats-py subscribed to them
        again, and after a short cut the server still holds them; asked for again, they would
        be served beside the new ones (8 slots, a 0.5 s cut, 60 s expiries: 16 of a burst of 16
        delivered). One a restarted server lost is given up at its expiry, by the next top-up
        (the worker's tick)."""
        moved = self.conn.nc.connected_url != self._server
        self._give_up_expired(everything=moved, asked_before=asked_before)

    async def top_up(self, *, whole: bool = False) -> None:
        """Ask for as many messages as there are free slots not yet covered by a request.

        While answers are in flight, slots freed one by one are asked for in chunks (a quarter
        of the slots), as nats.go's Consume does: one request per freed slot would pile up
        requests that each wait for one message, and the next answer to end frees the next
        slot soon. With nothing in flight, or with ``whole`` (the worker's tick), every free
        slot is covered: a burst that finds slots uncovered waits for a pull request's round
        trip behind the handlers of the burst's first part (about 6 ms for the last 7 of 32
        here), when one request's round trip would have served it all."""
        if self._stopped:
            return
        self._give_up_expired()
        while await self._ask(whole=whole):
            pass

    async def _ask(self, *, whole: bool) -> bool:
        """One pull request for free slots not yet covered (at most ``batch``); whether one was
        asked."""
        free = self._free()
        want = free - self.outstanding
        if want <= 0 or len(self._owed) >= MAX_REQUESTS:
            return False
        total = self._total()
        busy = free < total
        if not whole and busy and self._owed and want < max(1, total // 4):
            return False
        want = min(want, max(self._batch, -(-total // MAX_REQUESTS)))
        nc = self.conn.nc
        if not nc.is_connected:
            return False  # asked once the link is back (the worker's reconnect step, its tick)
        self._next += 1
        token = self._next
        spare = self._spares.pop() if self._spares else None
        inbox = nc.new_inbox() if spare is None else spare.subject
        expires = self._expires if self._expiry is None else min(self._expires, self._expiry())
        self._owed[token] = want
        self._server = nc.connected_url
        self._asked[token] = (asyncio.get_running_loop().time(), expires)

        def on_msg(msg: Msg) -> None:
            self._on_msg(token, msg)

        try:
            if spare is None:
                self._subs[token] = await subscribe_inline(nc, inbox, on_msg)
            else:
                retarget(spare, on_msg)
                self._subs[token] = spare
            request = {"batch": want, "expires": int(expires * 1_000_000_000)}
            await nc.publish(self._api, json.dumps(request).encode(), reply=inbox)
        except nats.errors.Error as exc:  # disconnected: the tick tries again
            self._end(token)
            log.warning("pull request not sent", error=repr(exc))
            return False
        return True

    def _on_msg(self, token: int, msg: Msg) -> None:
        """A message of pull request ``token``, in the connection's read loop."""
        # The server's word on the pull request comes with no reply subject; a delivery always
        # has its ack subject, whatever headers its sender set (`nats pub ... -H Status:503`
        # read as the server's 503: a restore for nothing, the message never settled).
        status = msg.headers.get("Status") if msg.headers and not msg.reply else None
        if status is not None and not msg.data:
            if status == HEARTBEAT:
                return
            # The request is over (expired, or the consumer could not serve it): what it still
            # owed goes back to the pool. After an error the worker's tick asks again, not this
            # callback, so a consumer that keeps refusing cannot spin us. An expired request's
            # inbox serves the next request, as a filled one's does: its status is the last
            # thing JetStream sends there (an idle worker's requests expire twice a second each).
            expired = status in ("404", "408")
            self._end(token, spare=expired)
            if expired:
                self._renew()
            else:
                reason = msg.headers.get("Description") if msg.headers else None
                log.warning("pull request refused", status=status, reason=reason)
                gone = status == "503" or (status == "409" and "deleted" in str(reason).lower())
                if gone and self._on_lost is not None:
                    self._on_lost(f"pull request ended: {status} {reason or ''}".strip())
            return
        owed = self._owed.get(token)
        filled = owed is not None and owed <= 1
        if filled:
            self._end(token, spare=True)  # filled: JetStream sends nothing more for it
        elif owed is not None:
            self._owed[token] = owed - 1
        if self._stopped:
            run_now(nak(msg), self._renewing, name="nak")
            return
        self.last_delivery = msg.reply
        self._deliver(msg)
        if filled:
            self._renew()  # a burst used the request up: cover the slots still free

    def _renew(self) -> None:
        """Top up now, from the read loop, and write the new request at once: a burst's rest
        may be waiting in the stream for it."""
        run_now(self.top_up(), self._renewing, name="pull")
        write_queued(self.conn.nc, at_least=1)

    def _end(self, token: int, *, spare: bool = False) -> None:
        """Request ``token`` is over: what it still owed goes back to the pool. ``spare``: it
        was filled, and its subscription is kept for the next request (up to
        :data:`MAX_REQUESTS` of them)."""
        self._owed.pop(token, None)
        self._asked.pop(token, None)
        self._lingering.pop(token, None)
        if spare and not self._stopped and len(self._spares) < MAX_REQUESTS:
            sub = self._subs.pop(token, None)
            if sub is not None:
                self._spares.append(sub)
            return
        self._later_close(token)

    def _give_up_expired(
        self, *, everything: bool = False, asked_before: float | None = None
    ) -> None:
        """Requests past their expiry with no status to say so (``everything``: all of
        them; ``asked_before``: those asked before then too): what they owed goes back to the
        pool. Each one's subscription stays for
        :data:`LINGER_S`, for a delivery still on its way (one asked while the link was down
        reached the server late, and expires late): a message is never sent where nobody reads
        it."""
        now = asyncio.get_running_loop().time()
        margin = EXPIRY_MARGIN_S + self._round_trip(now)
        before = -math.inf if asked_before is None else asked_before
        for token, (asked, expires) in list(self._asked.items()):
            if asked <= now - (expires + margin) or everything or asked < before:
                self._owed.pop(token, None)
                del self._asked[token]
                self._lingering[token] = now + LINGER_S
        for token, until in list(self._lingering.items()):
            if until <= now:
                self._end(token)

    def _later_close(self, token: int) -> None:
        """Unsubscribe outside the read loop (nats-py is in the middle of the message)."""
        task = asyncio.get_running_loop().create_task(self._close(token))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, token: int) -> None:
        sub = self._subs.pop(token, None)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()


async def nak(msg: Msg) -> None:
    """Hand ``msg`` back to the queue now (to another worker), not after ack_wait."""
    with contextlib.suppress(nats.errors.Error):
        await msg.nak()
