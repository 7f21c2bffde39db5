"""The worker's pull consumer: JetStream pull requests kept outstanding for exactly the worker's
free slots, deliveries taken in a callback and handed on at once.

nats-py's ``fetch`` waits for a batch (or its end) before returning and spends a task and a
timeout on every message; a worker behind it picks up a burst of requests one batch at a time.
Here each pull request has an inbox and a subscription of its own (JetStream delivers pulled
messages under their stream subject, so only the subscription tells which request a message
answers), and the puller knows how many messages each still owes; JetStream ends a request with
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
import json
from collections.abc import Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from mesh.eager import run_now
from mesh.inline_sub import subscribe_inline
from mesh.logs import get_logger
from mesh.write_now import write_queued

log = get_logger(__name__)
MAX_REQUESTS = 8
"""Pull requests one worker keeps outstanding at most (the consumer's max_waiting is shared)."""
HEARTBEAT = "100"


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
    ) -> None:
        self.conn = conn
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._free = free_slots
        self._total = total_slots
        self._deliver = deliver
        self._expires_ns = int(expires * 1_000_000_000)
        self._owed: dict[int, int] = {}
        self._subs: dict[int, Subscription] = {}
        self._next = 0
        self._stopped = True
        self._closing: set[asyncio.Task[None]] = set()
        self._renewing: set[asyncio.Task[None]] = set()

    @property
    def outstanding(self) -> int:
        """Messages asked for and not yet delivered."""
        return sum(self._owed.values())

    async def start(self) -> None:
        self._stopped = False
        await self.top_up()

    async def stop(self) -> None:
        self._stopped = True
        for token in list(self._subs):
            await self._close(token)
        for task in [*self._closing, *self._renewing]:
            await task

    def forget(self) -> None:
        """After a reconnect: the requests may have gone with the old connection (their
        subscriptions were restored, and a late delivery is still taken)."""
        self._owed.clear()

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
        free = self._free()
        want = free - self.outstanding
        if want <= 0 or len(self._owed) >= MAX_REQUESTS:
            return
        total = self._total()
        busy = free < total
        if not whole and busy and self._owed and want < max(1, total // 4):
            return
        self._next += 1
        token = self._next
        nc = self.conn.nc
        inbox = nc.new_inbox()
        self._owed[token] = want

        def on_msg(msg: Msg) -> None:
            self._on_msg(token, msg)

        try:
            self._subs[token] = await subscribe_inline(nc, inbox, on_msg)
            request = {"batch": want, "expires": self._expires_ns}
            await nc.publish(self._api, json.dumps(request).encode(), reply=inbox)
        except nats.errors.Error as exc:  # disconnected: the tick tries again
            self._owed.pop(token, None)
            self._later_close(token)
            log.warning("pull request not sent", error=repr(exc))

    def _on_msg(self, token: int, msg: Msg) -> None:
        """A message of pull request ``token``, in the connection's read loop."""
        status = msg.headers.get("Status") if msg.headers else None
        if status is not None and not msg.data:
            if status == HEARTBEAT:
                return
            # The request is over (expired, or the consumer could not serve it): what it still
            # owed goes back to the pool. After an error the worker's tick asks again, not this
            # callback, so a consumer that keeps refusing cannot spin us.
            self._owed.pop(token, None)
            self._later_close(token)
            if status in ("404", "408"):
                self._renew()
            else:
                reason = msg.headers.get("Description") if msg.headers else None
                log.warning("pull request refused", status=status, reason=reason)
            return
        owed = self._owed.get(token)
        filled = owed is not None and owed <= 1
        if filled:
            del self._owed[token]
            self._later_close(token)  # filled: JetStream sends nothing more for it
        elif owed is not None:
            self._owed[token] = owed - 1
        if self._stopped:
            run_now(nak(msg), self._renewing, name="nak")
            return
        self._deliver(msg)
        if filled:
            self._renew()  # a burst used the request up: cover the slots still free

    def _renew(self) -> None:
        """Top up now, from the read loop, and write the new request at once: a burst's rest
        may be waiting in the stream for it."""
        run_now(self.top_up(), self._renewing, name="pull")
        write_queued(self.conn.nc, at_least=1)

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
