"""Stopping a node's background tasks is bounded: a task that swallows its cancel (a bug) is
named in the log, and the shutdown goes on."""

from __future__ import annotations

import asyncio
import itertools
import time

from mesh.tasks import TaskSet, cancel_and_wait


async def test_a_task_that_ignores_its_cancel_holds_the_close_up_only_so_long() -> None:
    done = False
    ignoring = asyncio.Event()

    async def stubborn() -> None:
        while not done:
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                ignoring.set()  # the bug this guards against: the cancel is swallowed

    async def polite() -> None:
        await asyncio.sleep(10)

    tasks = TaskSet("test")
    tasks.spawn(stubborn(), name="stubborn")
    tasks.spawn(polite(), name="polite")
    await asyncio.sleep(0)
    began = time.monotonic()
    assert await cancel_and_wait(set(tasks._tasks), timeout=0.3) is False
    assert time.monotonic() - began < 2.0
    assert ignoring.is_set()
    assert [t.get_name() for t in tasks._tasks] == ["stubborn"]  # the polite one ended
    done = True
    assert await tasks.wait(2.0)


async def test_cancelled_tasks_that_end_are_waited_for_and_what_they_raised_is_taken() -> None:
    ended: list[str] = []

    async def cleans_up() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.sleep(0.05)  # cleanup that awaits, as a hand-back does
            ended.append("cleaned")

    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RuntimeError("failed while stopping") from None

    tasks = [asyncio.ensure_future(cleans_up()), asyncio.ensure_future(fails_on_cancel())]
    await asyncio.sleep(0)
    assert await cancel_and_wait(tasks) is True
    assert ended == ["cleaned"] and all(t.done() for t in tasks)


async def test_a_supervised_task_that_ran_well_is_restarted_at_once_after_its_next_crash() -> None:
    """Its pause doubles while it keeps crashing, up to a bound, and starts over once it has run
    well. Before, the pause only grew (to 30 s): a task that had crashed six times over a
    process's life (a leaf's blips, say) waited 30 s after every later crash, long after its
    cause was gone."""
    starts: list[float] = []
    crashed_again, restarted = asyncio.Event(), asyncio.Event()

    async def flaky() -> None:
        starts.append(time.monotonic())
        if len(starts) <= 8:
            raise ConnectionError("the store is electing a leader")
        if len(starts) == 9:
            await asyncio.sleep(0.6)  # longer than the longest pause: it ran well
            crashed_again.set()
            raise ConnectionError("a new blip")
        restarted.set()
        await asyncio.sleep(30)

    tasks = TaskSet("test")
    tasks.supervise(flaky, name="flaky", restart_delay=0.01, max_delay=0.5)
    await asyncio.wait_for(crashed_again.wait(), 10)
    pauses = [b - a for a, b in itertools.pairwise(starts)]
    assert max(pauses[:8]) < 0.5 + 0.2, pauses  # bounded while it kept crashing
    assert pauses[6] >= 0.4, pauses  # and grown to the bound by then
    await asyncio.wait_for(restarted.wait(), 10)
    assert starts[9] - starts[8] - 0.6 < 0.1, pauses  # after a good run: at once again
    await tasks.close(grace=0)
