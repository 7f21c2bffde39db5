"""``async with`` for everything that starts and stops (connections, servers, nodes, calls)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from mesh.logs import get_logger

log = get_logger(__name__)
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


async def start_or_undo(
    start: Awaitable[None], undo: Callable[[], Awaitable[None]], what: str, **fields: Any
) -> None:
    """Await ``start``; when it fails or is cancelled, ``undo()`` closes what of it started
    before its error goes on (a node that opened its intake must not go on answering). The
    undo's own failure is logged: the start's error is the one raised."""
    try:
        await start
    except BaseException:
        log.warning(f"{what} start failed; undoing what it started", **fields)
        try:
            await undo()
        except Exception:
            log.exception(f"undoing the {what}'s start failed")
        raise
