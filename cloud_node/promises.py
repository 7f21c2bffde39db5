"""Free slots this worker promised to peers that stop: what a stopping worker may hand over.

A worker stopping with SIGTERM hands as many of its answers in flight over to its peers as they
have room for (:meth:`cloud_node.serve.Handler.hand_over`); the rest it finishes itself. It
asks each peer on ``mesh.v1.worker.<id>.reserve`` (:func:`mesh.registry.claim_room`), and the
peer, in its own event loop, grants no more than its free slots less what it promised already:
two workers stopping at once never count one slot twice. Counted from registry entries instead,
they did (an entry is up to a heartbeat old, and says nothing of a promise); named by the
entry or the peer's deliveries, reservations in the registry bucket changed name as the
heartbeat or a delivery came, and a slot was promised again (review S19b).

A promise is kept by the next redelivery the peer takes (the answer handed over, or another
handed back) or lapses after :data:`PROMISE_S`. The peer keeps asking for every free slot, and
for its promises out less the requests it took over its slots since, unless its engine says it
is full (:meth:`Promises.to_pull`): a new request arriving in the few milliseconds between the
promise and the hand-over takes a slot, and the answer handed over is still taken, beside it,
over the engine's slots. Before, it waited in the queue for the new request's whole answer to
end; holding the new request back instead (a nak with a delay) would have spent one of its
deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import nats.errors
import orjson
from nats.aio.msg import Msg
from nats.micro.request import Request

PROMISE_S = 2.0
"""How long a promised slot stays promised when no delivery comes to take it."""
MAX_ASK = 1024
"""Slots one ask may ask for, at most (bounds what a hostile ask can hold)."""


class Promises:
    def __init__(self, free: Callable[[], int]) -> None:
        self._free = free
        self._until: deque[float] = deque()  # each promise's lapse, oldest first

    def grant(self, want: int, now: float | None = None) -> int:
        """Promise up to ``want`` free slots not promised already; how many were."""
        now = time.monotonic() if now is None else now
        granted = max(0, min(want, self._free() - self.held(now)))
        self._until.extend([now + PROMISE_S] * granted)
        return granted

    def held(self, now: float | None = None) -> int:
        """The promises neither kept nor lapsed."""
        now = time.monotonic() if now is None else now
        while self._until and self._until[0] <= now:
            self._until.popleft()
        return len(self._until)

    def to_pull(self, free: int, over: int, full: bool) -> int:
        """The messages a worker asks for: its ``free`` slots, and never fewer than its promises
        out less the requests it took ``over`` its slots since (each new one that took a
        promised slot is served beside the answer handed over, one over the slots each, for at
        most PROMISE_S). Only the free slots while its engine is ``full`` by its own word (a
        429 with Retry-After: what it pulled would be refused), down, or the worker stops."""
        return free if full else max(free, self.held() - max(0, over))

    def expiry(self, covered: bool, usual: float) -> float:
        """A pull request's expiry: ``usual``, or when the free slots are ``covered`` already
        (it asks for promised slots only) no longer than the promises last: a new request must
        not land over the slots after they lapsed, while an idle peer has room."""
        if not covered:
            return usual
        now = time.monotonic()
        return max(0.01, min(usual, self._until[-1] - now)) if self.held(now) else 0.01

    def kept(self, msg: Msg) -> None:
        """A delivery came: a redelivery (an answer handed over is one) takes a promised slot.
        A request's first delivery does not keep a promise: it took a free slot, and the answer
        promised one still comes (review S19d: it kept it, and another stopping peer could be
        promised the slot again)."""
        if msg.metadata.num_delivered > 1 and self.held():  # a live one, not one lapsed
            self._until.popleft()

    async def on_reserve(self, request: Request) -> None:
        """``{"want": n}``: answers ``{"granted": k}`` (0 to anything it cannot read)."""
        try:
            want = orjson.loads(request.data).get("want") if len(request.data) < 256 else None
        except (ValueError, AttributeError):
            want = None
        asked = min(want, MAX_ASK) if type(want) is int else 0
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await request.respond(orjson.dumps({"granted": self.grant(asked)}))
