"""Whether a worker's engine answers: its health, asked every second with a bound.

A worker whose engine is down (an OpenAI-compatible server that stopped, one that hangs) used
to say ``health: ok`` and announce every slot free: it pulled each request, failed it on every
delivery in about 2 s, and the client got ``max_deliveries``. While the watch says down, the
worker has no free slot (it pulls nothing; the queue keeps the requests for healthy workers),
announces its engine down (edges then count on no cloud there and answer locally at once), and
``mesh status`` shows why. It is up again at the first health check that answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from mesh.backends.base import Backend, health_within
from mesh.logs import get_logger

log = get_logger(__name__)

PROBE_S = 1.0
"""How often the engine's health is asked."""
DOWN_AFTER = 3
"""Failed checks in a row that make the engine down (one slow answer is a busy engine: vLLM
at full load may answer ``GET /models`` in more than a second)."""


class EngineWatch:
    def __init__(
        self,
        backend: Backend,
        on_change: Callable[[], Awaitable[None]],
        moving: Callable[[], bool] = lambda: False,
    ) -> None:
        self.backend = backend
        self.on_change = on_change
        self.moving = moving
        """Whether a generation made a token just now: a failed check then does not count."""
        self.failures = 0
        """Told when the engine goes down or comes back (the worker announces it)."""
        self.down: str | None = None
        """Why the engine is down (its last health check); None while it answers."""

    async def run(self) -> None:
        while True:
            health = await health_within(self.backend)
            if health.ok:
                self.failures = 0
            elif not self.moving():
                self.failures += 1
            down = None if health.ok else health.detail or "not ok"
            if down is not None and self.failures < DOWN_AFTER:
                down = self.down  # not yet: as it was (down stays down until a check answers)
            if (down is None) != (self.down is None):
                if down is None:
                    log.info("engine answers again", model=self.backend.model)
                else:
                    log.warning("engine down: pulling nothing", reason=down)
                self.down = down
                await self.on_change()
            self.down = down
            await asyncio.sleep(PROBE_S)
