"""Admission to the on-device model: its slots, plus a short bounded wait queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from mesh.backends.base import Backend
from protocol.errors import OverloadedError


class LocalGate:
    """At most ``slots`` local generations run; ``queue`` more may wait; beyond that, overloaded."""

    def __init__(self, backend: Backend, queue: int) -> None:
        self._slots = asyncio.Semaphore(backend.capacity().total)
        self._queue = queue
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def full(self) -> bool:
        """No slot free and no place left in the wait queue: :meth:`slot` would refuse."""
        return self._slots.locked() and self._waiting >= self._queue

    @asynccontextmanager
    async def slot(self, request_id: str, *, admitted: bool = False) -> AsyncIterator[None]:
        """A slot, waited for; refused when :attr:`full`, unless ``admitted`` (a request that
        held one before, given back to it)."""
        if self.full and not admitted:
            raise OverloadedError(
                f"the local model is busy and {self._waiting} requests already wait for it",
                retry_after=1.0,
                request_id=request_id,
            )
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._slots.release()
