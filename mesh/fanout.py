"""One subscription for every answer a node reads under its own scope.

A node that escalates many requests (an edge) would otherwise subscribe and unsubscribe once per
request: a SUB and an UNSUB on the wire, a nats-py subscription with its own queue and task, and,
behind a leaf node, interest that has to reach the hub before the first token does. An edge
owns its scope, so one wildcard subscription on ``mesh.v1.tok.<scope>.*``, made at start,
receives all of its answers. Each reader registers its request's token subject and is handed
that subject's messages; messages for subjects nobody reads any more are dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mesh.connection import Connection
from protocol.subjects import PREFIX

OnMsg = Callable[[Msg], Awaitable[None]]


class TokenFanout:
    def __init__(self, conn: Connection, scope: str) -> None:
        self.conn = conn
        self.scope = scope
        self._prefix = f"{PREFIX}.tok.{scope}."
        self._routes: dict[str, list[OnMsg]] = {}
        self._sub: Subscription | None = None

    def covers(self, subject: str) -> bool:
        """True when ``subject``'s messages reach this fanout (it is started, and the subject is
        a token subject of its scope)."""
        return self._sub is not None and subject.startswith(self._prefix)

    async def start(self) -> None:
        """Subscribe, and wait until the server has the subscription: from then on nothing
        published to the scope's token subjects can pass it by."""
        self._sub = await self.conn.nc.subscribe(f"{self._prefix}*", cb=self._on_msg)
        await self.conn.nc.flush(timeout=max(1, round(self.conn.settings.request_timeout)))

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._routes.clear()

    def add(self, subject: str, on_msg: OnMsg) -> None:
        self._routes.setdefault(subject, []).append(on_msg)

    def remove(self, subject: str, on_msg: OnMsg) -> None:
        readers = self._routes.get(subject)
        if readers is None:
            return
        with contextlib.suppress(ValueError):
            readers.remove(on_msg)
        if not readers:
            del self._routes[subject]

    async def _on_msg(self, msg: Msg) -> None:
        for on_msg in tuple(self._routes.get(msg.subject, ())):
            await on_msg(msg)
