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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from mesh.logs import get_logger

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
        deliver: Callable[[Msg], Awaitable[None]],
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
        for task in list(self._closing):
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

        async def on_msg(msg: Msg) -> None:
            await self._on_msg(token, msg)

        try:
            self._subs[token] = await nc.subscribe(inbox, cb=on_msg)
            request = {"batch": want, "expires": self._expires_ns}
            await nc.publish(self._api, json.dumps(request).encode(), reply=inbox)
        except nats.errors.Error as exc:  # disconnected: the tick tries again
            self._owed.pop(token, None)
            self._later_close(token)
            log.warning("pull request not sent", error=repr(exc))

    async def _on_msg(self, token: int, msg: Msg) -> None:
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
                await self.top_up()
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
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()  # hand it to another worker now, not after ack_wait
            return
        await self._deliver(msg)
        if filled:
            await self.top_up()  # a burst used the request up: cover the slots still free

    def _later_close(self, token: int) -> None:
        """Unsubscribe outside the subscription's own callback (which runs in its task)."""
        task = asyncio.get_running_loop().create_task(self._close(token))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, token: int) -> None:
        sub = self._subs.pop(token, None)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
