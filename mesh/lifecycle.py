"""``async with`` for everything that starts and stops (connections, servers, nodes, calls)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, TypeVar

_T = TypeVar("_T", bound="Lifecycle")


class Lifecycle:
    """``async with thing:`` runs ``await thing.start()``, then ``await thing.stop()``."""

    async def start(self) -> Any:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: _T) -> _T:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
