"""Stopping a node's background tasks is bounded: a task that swallows its cancel (a bug) is
named in the log, and the shutdown goes on."""

from __future__ import annotations

import asyncio
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
