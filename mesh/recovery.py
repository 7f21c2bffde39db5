"""Putting back what a reconnect may have lost, until it is back.

A server restart, a leader election or a link cut can take a node's watches, consumers, KV
handles and registry entries with it. Each node names the steps that put them back; after every
reconnect :class:`Recovery` runs each step, and when one fails (the hub is still electing a
leader, JetStream has no quorum yet, the request timed out) runs it again with a growing delay
(0.1 s doubling to 2 s) until it succeeds. It never gives up: a step that failed once used to
leave an edge answering every cloud request locally for good while every worker was healthy.

State can also go without a reconnect (an operator's ``nats consumer rm``, a stream lost on a hub
server the node is not connected to); a node that hears so from the server (JetStream's advisory
that it was deleted, a pull request ended with "Consumer Deleted") calls :meth:`Recovery.again`
for the step that puts it back. Heard while that step runs, the step runs once more after it:
the run under way may have put things back before the loss.

A newer reconnect restarts a step still being retried. While any step is not restored,
:attr:`Recovery.pending` names it, and readiness (the edge's ``/ready``, a worker's status and
``mesh status``) says so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from mesh.logs import get_logger
from mesh.tasks import cancel_and_wait, raise_if_cancelled

log = get_logger(__name__)

Step = Callable[[], Coroutine[Any, Any, None]]

FIRST_DELAY = 0.1
"""Seconds before the first retry of a failed step; doubled after each failure."""
MAX_DELAY = 2.0
"""The longest wait between two tries: a step is restored at most this long after its cause
is gone (an election typically ends within a few seconds)."""
STEP_TIMEOUT = 30.0
"""A bound on one try, on top of the steps' own network timeouts."""


class Recovery:
    """The steps one connection runs after every reconnect, each retried until it succeeds."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._steps: dict[int, tuple[str, Step]] = {}
        self._running: dict[int, tuple[str, asyncio.Task[None]]] = {}
        self._next = 0
        self._closed = False
        self._rerun: set[int] = set()
        """Steps asked for again while they ran: they run once more when they succeed."""
        self._waiting: set[int] = set()
        """Steps in the pause before a run (:meth:`_wait`)."""
        self._again: dict[int, tuple[float, float]] = {}
        """Each step run by :meth:`again`: when it last succeeded (``time.monotonic()``), and the
        pause before the next such run if it is asked for within :data:`MAX_DELAY` of that."""
        self.failures = 0
        """Failed tries since start (every step): a figure for metrics."""

    def add(self, name: str, step: Step) -> Callable[[], None]:
        """Run ``step`` after every reconnect, until it succeeds; returns an undo. ``name``
        says what it restores (several steps may share one)."""
        key = self._next
        self._next += 1
        self._steps[key] = (name, step)

        def undo() -> None:
            self._steps.pop(key, None)
            self._rerun.discard(key)
            running = self._running.pop(key, None)
            if running is not None:
                running[1].cancel()

        return undo

    @property
    def pending(self) -> list[str]:
        """What is not restored since the last reconnect, by name."""
        return sorted({name for name, _task in self._running.values()})

    def reconnected(self) -> None:
        """Start (or start again) every step."""
        if self._closed:
            return
        for key, (name, step) in list(self._steps.items()):
            self._rerun.discard(key)  # the run starting now covers it
            old = self._running.pop(key, None)
            if old is not None:
                old[1].cancel()
            self._start(key, name, step)

    def again(self, name: str, why: str) -> bool:
        """Run the steps named ``name`` now, without a reconnect: what they put back was lost
        (``why``, for the log). One running already runs once more when it succeeds (it may
        have put things back before the loss); True when a step started. Asked for again
        within :data:`MAX_DELAY` of its last success (the state it put back lost at once again,
        or a sign of loss that outlives it: a pull answered 503 while provisioning succeeds), a
        step waits first, 0.1 s doubling to 2 s: never a storm of provisioning."""
        if self._closed:
            return False
        now = time.monotonic()
        due = []
        for key, (named, step) in self._steps.items():
            if named != name:
                continue
            running = self._running.get(key)
            if running is not None and not running[1].done():
                if key not in self._waiting:  # waiting to begin, its run comes after this word
                    self._rerun.add(key)
            else:
                due.append((key, step))
        for key, step in due:
            self._start(key, name, step, self._pace(key, now))
        if due:
            log.warning(
                "lost without a reconnect; restoring", connection=self._owner, step=name, why=why
            )
        return bool(due)

    async def settled(self, name: str, within: float) -> bool:
        """Wait up to ``within`` seconds for the steps named ``name`` that are running to end;
        whether none is pending then (a caller that asked :meth:`again` retries its work)."""
        tasks = [task for named, task in self._running.values() if named == name]
        if tasks:
            await asyncio.wait(tasks, timeout=within)
        return name not in self.pending

    def _start(self, key: int, name: str, step: Step, wait: float = 0.0) -> None:
        task = asyncio.get_running_loop().create_task(
            self._restore(key, name, step, wait), name=f"restore-{name}"
        )
        self._running[key] = (name, task)
        self._waiting.add(key)  # a loss heard before the task's first step: its run finds it
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        for key, (_name, running) in list(self._running.items()):
            if running is task:
                del self._running[key]
                self._waiting.discard(key)  # cancelled before its first step

    async def _restore(self, key: int, name: str, step: Step, wait: float) -> None:
        await self._wait(key, wait)
        delay = FIRST_DELAY
        tries = 0
        while True:
            raise_if_cancelled()  # one a step's own wait_for swallowed (Python 3.11)
            tries += 1
            try:
                await asyncio.wait_for(step(), STEP_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                # Every failure is worth a line while it lasts, but not ten a second.
                if tries == 1 or delay >= MAX_DELAY:
                    log.warning(
                        "not restored after a reconnect; trying again",
                        connection=self._owner,
                        step=name,
                        tries=tries,
                        error=repr(exc),
                        retry_in_s=delay,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_DELAY)
                continue
            if tries > 1:
                log.info(
                    "restored after a reconnect", connection=self._owner, step=name, tries=tries
                )
            rerun = key in self._rerun  # lost again while it ran: once more, paced as again()
            self._rerun.discard(key)
            wait = self._pace(key, time.monotonic()) if rerun else 0.0
            if key in self._again:  # its success, after the pace read the one before
                self._again[key] = (time.monotonic(), self._again[key][1])
            if not rerun:
                return
            await self._wait(key, wait)
            tries, delay = 0, FIRST_DELAY

    async def _wait(self, key: int, wait: float) -> None:
        """The pause before a run: a loss heard meanwhile is one that run will find, not a
        reason for another run after it. One deletion is often heard several times (JetStream's
        advisory, then each open pull request ended "Consumer Deleted"): each word counted as a
        loss of its own doubled the pause once more for the same loss, and a consumer deleted
        four times a second apart came back 0.05, 0.10, 0.42 and 1.65 s later (review S27a)."""
        self._waiting.add(key)  # from the step's start (_start) or success on, until it runs
        try:
            if wait > 0:
                await asyncio.sleep(wait)
        finally:
            self._waiting.discard(key)

    def _pace(self, key: int, now: float) -> float:
        """How long a step asked for again waits first: its last pause doubled while it is
        asked for within :data:`MAX_DELAY` of its last success (flapping), none after a quiet
        spell."""
        succeeded, pause = self._again.get(key, (-MAX_DELAY, 0.0))
        wait = pause if now - succeeded < MAX_DELAY else 0.0
        self._again[key] = (succeeded, min(max(wait * 2, FIRST_DELAY), MAX_DELAY))
        return wait

    async def close(self) -> None:
        self._closed = True  # nothing starts any more: a late again() would run on for ever
        tasks = [task for _name, task in self._running.values()]
        self._running.clear()
        await cancel_and_wait(tasks)
