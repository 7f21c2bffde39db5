"""Coroutines run now, up to their first real wait, instead of at the event loop's next turn.

Python 3.11 starts a task at the loop's next turn, after every callback already queued. In a
burst those callbacks are the rest of the burst, so work that could have gone out at once (a
request's bytes, a pull request renewed) waits for all of it. Python 3.12's eager tasks run a
coroutine's first step in the call that creates it; this module does the same on 3.11, where a
write would otherwise wait behind a burst: the engine's request (:mod:`mesh.backends.eager_send`,
measured in ``docs/performance.md``) and a pull request's renewal (:mod:`cloud_node.puller`).
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Coroutine, Generator
from typing import Any

from mesh.logs import get_logger

log = get_logger(__name__)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Generator[Any, Any, Any]:
    """Go on running ``coro``, already started, from where it yielded ``yielded``: what
    ``await`` does, for a coroutine whose first step has run outside any task. Each value it
    yields goes to the task running this; what the task sends or throws goes back in."""
    while True:
        try:
            received = yield yielded
        except BaseException as exc:  # cancellation included: the coroutine decides
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            yielded = coro.send(received)
        except StopIteration as stop:
            return stop.value


async def _finished(value: Any) -> Any:
    return value


async def _raise(exc: BaseException) -> Any:
    raise exc


def start_now(coro: Coroutine[Any, Any, Any]) -> Coroutine[Any, Any, Any]:
    """Run ``coro`` now, up to its first wait; returns a coroutine that runs the rest (or
    returns its result at once), for a task to run. An exception raised before the first wait
    is raised by that coroutine, as it would have been by ``coro`` in its task."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return _finished(stop.value)
    except BaseException as exc:
        return _raise(exc)
    return _resume(coro, yielded)


async def cancel_started(step: Coroutine[Any, Any, Any]) -> None:
    """Cancel what :func:`start_now` returned, never awaited: throw the cancel in where its first
    step waits, as a task would, and run its cleanup to the end. How it ends (the cancel, an
    error, a value) is not wanted: taken here."""
    try:
        step.send(None)  # to where it waits (it ends here if its first step ended)
        yielded = step.throw(asyncio.CancelledError())
    except BaseException:  # ended: by the cancel, an error or a value
        return
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await _resume(step, yielded)


def run_now(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Task[None]], *, name: str) -> None:
    """Run ``coro`` now, up to its first wait, and the rest (if any) in a task kept in
    ``tasks`` until it ends. What it raises is logged, as a supervised task's would be."""
    try:
        yielded = coro.send(None)
    except StopIteration:
        return
    except Exception:
        log.exception("task failed", task=name)
        return
    task = asyncio.get_running_loop().create_task(_logged(_resume(coro, yielded), name), name=name)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _logged(rest: Coroutine[Any, Any, None], name: str) -> None:
    try:
        await rest
    except Exception:
        log.exception("task failed", task=name)
