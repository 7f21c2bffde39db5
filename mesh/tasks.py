"""Tracked background tasks: every task has an owner that can wait for it or cancel it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from mesh.logs import get_logger
from protocol.errors import DeadlineExceededError

log = get_logger(__name__)
T = TypeVar("T")
RESTART_MAX_S = 2.0
"""The longest pause before a crashed background task runs again (:meth:`TaskSet.supervise`):
like a recovery step (:mod:`mesh.recovery`), it is back at most this long after its cause."""
CANCELLED_WAIT_S = 5.0
"""How long stopping waits for cancelled tasks to end (their cleanup may hand a delivery back
over the network, with timeouts of its own well within this)."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], timeout: float = CANCELLED_WAIT_S
) -> bool:
    """Cancel ``tasks`` and wait ``timeout`` seconds at most for them to end; False when some
    did not (logged by name: a task that ignores its cancellation is a bug, and must not hold a
    node's shutdown for ever). What they raised is taken here, not left to the garbage
    collector's warnings."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return True
    done, left = await asyncio.wait(pending, timeout=timeout)
    for task in done:
        if not task.cancelled():
            task.exception()
    if left:
        names = sorted(t.get_name() if isinstance(t, asyncio.Task) else repr(t) for t in left)
        log.warning("tasks did not end when cancelled", tasks=names, waited_s=timeout)
    return not left


async def first_of(
    work: Coroutine[Any, Any, Any], gave_up: asyncio.Event, timeout: float | None = None
) -> tuple[bool, Any]:
    """Await ``work`` for at most ``timeout`` seconds (None: no limit; then asyncio.TimeoutError):
    ``(True, its result)`` when it ended, ``(False, None)`` as soon as ``gave_up`` is set (set
    already: at once). Either way short of its end, ``work`` is cancelled."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(gave_up.wait())
    try:
        done, _ = await asyncio.wait(
            {task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    except BaseException:  # cancelled: the work goes too, as under wait_for
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    if waiter in done:
        return False, None
    raise asyncio.TimeoutError


def raise_if_cancelled() -> None:
    """Raise the cancel an inner ``asyncio.wait_for`` swallowed. On Python 3.11, ``wait_for``
    returns the result instead of raising ``CancelledError`` when what it waits on finishes in
    the same loop turn as the cancel: likely when a process that stood still (paused, starved)
    resumes with everything ready at once. The task still counts the cancel as requested
    (``Task.cancelling``), so a loop that calls this on each turn stops as it was asked to.
    (The edge's relay ran a cancelled request to its end in 3 of 4 runs of
    ``tests/chaos/test_pauses.py``'s edge pause; with this, in none of 5.)"""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


def answered_cancel() -> None:
    """Called by a task that caught ``CancelledError`` and goes on, having acted on the cancel
    (a deadline's, a client's): the cancel no longer counts as requested, so that no later
    :func:`raise_if_cancelled` (in what it still sends) takes it for a new one."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    while cancelling is not None and cancelling():
        task.uncancel()  # type: ignore[union-attr]


async def by_deadline(deadline: float, work: Awaitable[T]) -> T:
    """``work``, given until ``deadline`` (Unix seconds): past it, ``asyncio.TimeoutError``."""
    return await asyncio.wait_for(work, max(0.0, deadline - time.time()))


CLOCK_SLACK_S = 0.001
"""A wait that ends this near a deadline ended at it (timers run a little early or late)."""


async def within_deadline(deadline: float | None, work: Awaitable[T], request_id: str) -> T:
    """``work`` until ``deadline`` (Unix seconds; None: its own timeouts), then a typed error."""
    if deadline is None:
        return await work
    try:
        return await by_deadline(deadline, work)
    except asyncio.TimeoutError:
        raise_if_cancelled()
        if time.time() < deadline - CLOCK_SLACK_S:
            raise  # the work's own timeout, not the deadline
        raise DeadlineExceededError(
            "the request's deadline passed before it was queued", request_id=request_id
        ) from None


class TaskSet:
    """Owns background tasks; failures are logged, never lost; ``close()`` cancels what is left."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(
        self, coro: Coroutine[Any, Any, Any], *, name: str | None = None
    ) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def supervise(
        self,
        factory: Callable[[], Coroutine[Any, Any, Any]],
        *,
        name: str,
        restart_delay: float = 0.5,
        max_delay: float = RESTART_MAX_S,
    ) -> asyncio.Task[Any]:
        """Run ``factory()`` as a tracked task; when it crashes, log it and run it again, until
        it returns or is cancelled. The pause before a restart doubles from ``restart_delay``
        up to ``max_delay`` while it keeps crashing, and starts over after a run that lasted
        ``max_delay`` or more: a task that crashed a few times over a day is not restarted a
        long while after its next cause is gone."""

        async def runner() -> None:
            delay = restart_delay
            while True:
                began = time.monotonic()
                try:
                    await factory()
                    return
                except Exception as exc:
                    if time.monotonic() - began >= max_delay:
                        delay = restart_delay  # it ran well: this crash is a new one
                    log.error(
                        "background task crashed; restarting it",
                        owner=self._name,
                        task=name,
                        error=repr(exc),
                        exc_info=exc,
                        restart_in_s=delay,
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, max_delay)

        return self.spawn(runner(), name=name)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error(
                "background task failed",
                owner=self._name,
                task=task.get_name(),
                error=repr(exc),
                exc_info=exc,
            )

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait for every task to finish; False if some were still running after ``timeout``."""
        if not self._tasks:
            return True
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return not pending

    async def close(self, grace: float = 0.0) -> None:
        """Give tasks ``grace`` seconds to finish, then cancel the rest and wait for them."""
        if grace > 0:
            await self.wait(grace)
        await cancel_and_wait(set(self._tasks))


class CancelAt:
    """Cancels ``task`` once ``deadline`` (Unix seconds; None: never) passes, unless
    :meth:`stop` came first or ``unless()`` says its work is ending already; with ``again``,
    once more every ``again`` seconds while it still runs (a cancel some await swallowed).
    :attr:`expired` tells the task's handler of ``CancelledError`` that the deadline, not a
    caller, cancelled it."""

    __slots__ = ("_again", "_handle", "_task", "_unless", "expired")

    def __init__(
        self,
        task: asyncio.Task[Any],
        deadline: float | None,
        *,
        unless: Callable[[], bool] | None = None,
        again: float | None = None,
    ) -> None:
        self._task = task
        self._unless = unless
        self._again = again
        self.expired = False
        self._handle: asyncio.TimerHandle | None = None
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._handle = loop.call_at(loop.time() + deadline - time.time(), self._expire)

    def _expire(self) -> None:
        self._handle = None
        if self._task.done() or (self._unless is not None and self._unless()):
            return
        self.expired = True
        self._task.cancel()
        if self._again is not None:
            self._handle = asyncio.get_running_loop().call_later(self._again, self._expire)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
