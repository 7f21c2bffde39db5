"""Whether a worker's engine answers: its health, asked every second with a bound.

A worker whose engine is down (an OpenAI-compatible server that stopped, one that hangs) used
to say ``health: ok`` and announce every slot free: it pulled each request, failed it on every
delivery in about 2 s, and the client got ``max_deliveries``. While the watch says down, the
worker has no free slot (it pulls nothing; the queue keeps the requests for healthy workers),
announces its engine down (edges then count on no cloud there and answer locally at once), and
``mesh status`` shows why. It is up again at the first health check that answers.

A check refused or failed (nothing listens, a server error) makes it down at once, as does the
first check at start; one not answered in time counts only three in a row, and none while its
answers make tokens (vLLM at full load may answer ``GET /health`` in more than a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from mesh.backends.base import Backend, Health, health_within
from mesh.logs import get_logger

log = get_logger(__name__)

PROBE_S = 1.0
"""How often the engine's health is asked."""
DOWN_AFTER = 3
"""Checks not answered in time, in a row, that make the engine down."""


class EngineWatch:
    def __init__(
        self,
        backend: Backend,
        on_change: Callable[[], Awaitable[None]],
        moving: Callable[[], bool] = lambda: False,
    ) -> None:
        self.backend = backend
        self.on_change = on_change
        """Told when the engine goes down or comes back (the worker announces it)."""
        self.moving = moving
        """Whether a generation made a token just now: a slow check then does not count."""
        self.slow = 0
        """Checks not answered in time, in a row."""
        self.down: str | None = None
        """Why the engine is down (its last health check); None while it answers."""

    async def first(self) -> None:
        """The check at start, before the worker pulls anything: an engine not there (still
        loading) is down at once, and a request queued meanwhile waits for it."""
        self.down = _why(await health_within(self.backend))
        if self.down is not None:
            log.warning("engine down: pulling nothing", reason=self.down)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            health = await health_within(self.backend)
            if health.ok:
                self.slow = 0
            elif health.slow and not self.moving():
                self.slow += 1
            down = _why(health)
            if down is not None and health.slow and self.slow < DOWN_AFTER:
                down = self.down  # not yet: as it was (down stays down until a check answers)
            was, self.down = self.down, down
            if (down is None) != (was is None):
                if down is None:
                    log.info("engine answers again", model=self.backend.model)
                else:
                    log.warning("engine down: pulling nothing", reason=down)
                await self.on_change()


def _why(health: Health) -> str | None:
    """Why the engine is down by this check; None when it answered."""
    return None if health.ok else health.detail or "not ok"
